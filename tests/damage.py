"""Damage done to checkpoint files on purpose, as a disk or a copy would do it."""

from __future__ import annotations

import random
from pathlib import Path


def flip_middle_bytes(path: Path) -> None:
    """Inverts 8 bytes in the middle of the file (tensor data in a shard); its size stays."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(data)


def same_size_garbage(path: Path, seed: int = 0) -> None:
    """Replaces the file's bytes by random ones of the same count."""
    path.write_bytes(random.Random(seed).randbytes(path.stat().st_size))


def resign(path: Path) -> None:
    """Recomputes a checkpoint's checksums after its files were changed, as anyone who can write
    the checkpoint can: the checksums catch damage, not an attacker."""
    import json

    from dtrain.checkpoint import integrity
    from dtrain.checkpoint import storage as ckpt

    meta = json.loads((path / ckpt.META).read_text())
    meta["files"] = integrity.manifest(path, [])
    ckpt.write_meta(path, meta)
