"""What keeps a checkpoint honest: a checksum of every file, written at commit and verified before
a load; weights checked finite before a save; the directory checked writable before the first step.

Each rank hashes the files it wrote (in the background for async saves) and rank 0 gathers the
lists into meta.json; COMPLETE holds the checksum of meta.json itself. At resume the ranks verify
the files in parallel, each its share, before any of them is unpickled or loaded.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import socket
import zlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dtrain.checkpoint.reader import inside

CHUNK_BYTES = 16 << 20
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
LOW_SPACE_BYTES = 16 << 20  # a device with less free than this after a failed save: it is full
# Written by the commit after the checksums are gathered: not part of the manifest.
UNLISTED = ("meta.json", "COMPLETE")
# DCP's FileSystemWriter names each rank's shard files __RANK_N.distcp (RANK in the save's group).
_DCP_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def checksum(path: Path) -> dict[str, int | str]:
    """Size and CRC-32 of a file, read in chunks (zlib releases the GIL while it hashes)."""
    crc, size = 0, 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": f"{crc:08x}"}


def text_checksum(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def _relative_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and str(p.relative_to(directory)) not in UNLISTED)


def own_checksums(directory: Path, rank: int) -> dict[str, dict]:
    """Checksums of the files `rank` wrote into a save: its DCP shards and RNG states, and DCP's
    .metadata on rank 0."""
    mine = []
    for name in _relative_files(directory):
        m = _DCP_SHARD.match(name)
        if (m and int(m.group(1)) == rank) or name == f"rng/rank_{rank:05d}.pt" or (rank == 0 and name == ".metadata"):
            mine.append(name)
    return {name: checksum(directory / name) for name in mine}


def manifest(directory: Path, gathered: list[dict[str, dict]]) -> dict[str, dict]:
    """Rank 0 at commit: every rank's checksums, and its own for any file no rank claimed (a
    writer that names its files otherwise), so that the manifest covers the whole directory."""
    merged = {name: entry for own in gathered for name, entry in own.items()}
    for name in _relative_files(directory):
        if name not in merged:
            merged[name] = checksum(directory / name)
    return dict(sorted(merged.items()))


def verify(directory: Path, files: dict[str, dict], rank: int = 0, world_size: int = 1) -> list[str]:
    """This rank's share of the listed files (every `world_size`-th, from `rank`), checked against
    their size and checksum; returns the problems found ([] when all match). `.metadata` is checked
    by every rank, since each one unpickles it next."""
    problems = []
    for index, (name, expected) in enumerate(sorted(files.items())):
        if index % world_size != rank and name != ".metadata":
            continue
        path = directory / name
        if not inside(directory, name):  # never read a file the manifest names elsewhere
            problems.append(f"file {name!r} lies outside the checkpoint")
            continue
        if not path.is_file():
            problems.append(f"file {name} is missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            problems.append(f"file {name} has {size} bytes, {expected['size']} when saved")
        elif checksum(path)["crc32"] != expected["crc32"]:
            problems.append(f"file {name} does not match its checksum")
    return problems


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def count_nonfinite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """How many of this rank's parameter and optimizer-state shards hold a NaN or an infinity."""
    tensors = [_local(p) for p in model.parameters()]
    for state in optimizer.state.values():
        tensors.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return 0
    largest = torch.stack(torch._foreach_norm(tensors, ord=math.inf))
    return int((~torch.isfinite(largest)).sum())


def write_problem(directory: Path) -> str | None:
    """Why this process cannot create files in `directory` (None when it can), found by creating
    and removing one: permission bits say nothing of a read-only mount, or to root."""
    probe = directory / f".write_test.{socket.gethostname()}.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.write(fd, b"dtrain")
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno in NO_SPACE:
            return f"no space is left on its device ({socket.gethostname()})"
        return f"{error.strerror or type(error).__name__} ({socket.gethostname()})"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()  # created even where its write then failed (a full disk)
    return None


def free_bytes(directory: Path) -> float:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return math.inf
    return stats.f_bavail * stats.f_frsize


def out_of_space(directory: Path, error: BaseException) -> bool:
    """Whether a failed save ran out of space: ENOSPC or EDQUOT anywhere in the error (DCP gathers
    every rank's failure into one), or the device nearly full now (torch.save reports a short
    write as "unexpected pos", with no errno)."""
    seen, pending = set(), [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return True
        pending += [e.__cause__, e.__context__]
        pending += [f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()]
    return free_bytes(directory) < LOW_SPACE_BYTES
