"""Distributed checkpoints of the whole train state, committed atomically, resumable on any mesh.

A checkpoint is `run_dir/checkpoints/step_000100/`:

    .metadata, __0_0.distcp, ...  torch DCP: parameters and optimizer state keyed by parameter
                                  name (`embed.weight`, `blocks.3.attn.wq`), so a load on
                                  another mesh reshards; with FP8 delayed scaling, its amax
                                  histories and scales per layer (`fp8.blocks.3.scale`)
    rng/rank_00000.pt             each rank's torch RNG states
    meta.json                     step, LR-scheduler state, model shape, resolved config, mesh, the
                                  data position (samples consumed), the skipped steps, and the size
                                  and CRC-32 of every other file (format 2)
    COMPLETE                      written by rank 0 after every rank finished writing: the step,
                                  and the CRC-32 of meta.json (format 2)

A save is written into `step_000100.tmp/` and renamed to its final name only once complete, so a
process killed at any moment leaves the previous checkpoint as the latest valid one. Format 1
(before checksums) still loads, unverified. What each rank writes: `dtrain.checkpoint.train_state`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from dtrain.checkpoint import integrity, meta_fields, reader
from models.config import LlamaConfig
from models.errors import UserError

logger = logging.getLogger("dtrain")

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
META = "meta.json"
LATEST = "latest"  # the value of a bare --resume: the latest checkpoint of --run-dir, which must exist
AUTO = "auto"  # --resume auto: the latest checkpoint of --run-dir if it ever had one, else step 0
MAX_REREADS = 5  # times a reader takes the newest checkpoint again after the one it read was pruned
CORRUPT = ".corrupt"  # the suffix of a checkpoint a resume found corrupt and set aside
FP8 = "fp8"  # the state dict entry of FP8 delayed scaling's state
_NAME = re.compile(r"^step_(\d+)$")
_SET_ASIDE = re.compile(r"^step_\d+\.corrupt$")
# Names this module may leave behind when a process dies: a save in progress, a replaced one.
_LEFTOVER = re.compile(r"^step_\d+(\.tmp|\.old)?$")


class CorruptCheckpoint(UserError):
    """A checkpoint whose files are missing, truncated or altered: a resume may fall back to an
    earlier one (unlike a checkpoint of another model, which is refused)."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def valid_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in root.iterdir()
             if (m := _NAME.match(child.name)) and (child / COMPLETE).is_file()]
    return sorted(found)


def recover_commits(root: Path) -> list[str]:
    """A commit killed between its two renames (the step's earlier checkpoint moved aside as
    step_N.old, the new one not yet renamed from step_N.tmp) leaves the new checkpoint whole under
    its temporary name, COMPLETE written: it takes its final name. Returns the names recovered."""
    recovered = []
    for tmp in sorted(root.glob("step_*.tmp")) if root.is_dir() else []:
        final = tmp.with_suffix("")
        if _NAME.match(final.name) and (tmp / COMPLETE).is_file() and not final.exists():
            tmp.rename(final)
            _sync_dir(root)
            recovered.append(final.name)
    return recovered


def remove_incomplete(root: Path) -> list[str]:
    """Deletes what interrupted saves left under `root`; returns the names removed."""
    removed = []
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.is_dir() and _LEFTOVER.match(child.name) and not (
                    _NAME.match(child.name) and (child / COMPLETE).is_file()):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return removed


def resume_candidates(value: str, run_dir: Path) -> tuple[list[Path], bool]:
    """The checkpoints that `--resume VALUE` may load, newest first, and whether VALUE named one
    checkpoint (then it is the only candidate). `latest` is the run directory's committed ones
    (none yet: []), and so is `auto`; a path is a step directory or a directory holding them."""
    if value in (LATEST, AUTO):
        return [path for _, path in reversed(valid_checkpoints(run_dir / CHECKPOINTS))], False
    path = Path(value)
    if not path.is_dir():
        raise UserError(f"--resume {value}: no such directory; pass a checkpoint (step_NNNNNN), a run "
                        f"directory, or --resume alone for the latest checkpoint of --run-dir")
    candidates, named = checkpoints_at(path)
    if not candidates:
        raise UserError(f"--resume {value}: holds no complete checkpoint (a step_NNNNNN directory with a "
                        f"{COMPLETE} file); pass another directory or leave --resume out")
    return candidates, named


def set_aside(root: Path) -> list[str]:
    """The checkpoints under `root` that a resume found corrupt and renamed `step_N.corrupt`."""
    if not root.is_dir():
        return []
    return sorted(child.name for child in root.iterdir() if child.is_dir() and _SET_ASIDE.match(child.name))


def checkpoints_at(path: Path) -> tuple[list[Path], bool]:
    """The checkpoints a directory names, newest first, and whether it is one checkpoint (then the
    only candidate): a step directory, or a run or checkpoints directory holding committed ones
    (none: [])."""
    if _NAME.match(path.name) or (path / META).exists() or (path / ".metadata").exists():
        return [path], True
    for root in (path / CHECKPOINTS, path):
        found = valid_checkpoints(root)
        if found:
            return [p for _, p in reversed(found)], False
    return [], False


def model_shape(cfg: LlamaConfig) -> dict[str, Any]:
    """The config's fields by the names its constructor takes (`head_dim`, stored as explicit_head_dim),
    lists for tuples, as meta.json holds them."""
    values = attrs.asdict(cfg, value_serializer=lambda _, __, value: list(value) if isinstance(value, tuple) else value)
    return {f.alias: values[f.name] for f in attrs.fields(type(cfg))}


def shape_defaults(cfg: LlamaConfig) -> dict[str, Any]:
    """What a checkpoint saved before a field was added counts it as: the field's default, as
    `model_shape` writes values."""
    return {f.alias: list(f.default) if isinstance(f.default, tuple) else f.default
            for f in attrs.fields(type(cfg)) if f.default is not attrs.NOTHING}


def shape_difference(saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """The fields that change parameter shapes or the forward math (init_std does neither). A field
    an older checkpoint lacks (added since) counts as its default, from `defaults`."""
    defaults = defaults or {}
    return [key for key in current if key != "init_std" and saved.get(key, defaults.get(key)) != current[key]]


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, after checking that the save was committed and, where COMPLETE
    holds its checksum (format 2), that meta.json is the one committed."""
    if not (path / COMPLETE).is_file():
        raise UserError(f"checkpoint {path} is incomplete (no {COMPLETE} file: its save was interrupted); "
                        f"resume from an earlier step_NNNNNN directory")
    reader.check_links(path)  # before any of its files is read
    try:
        marker = (path / COMPLETE).read_text().split()
        text = (path / META).read_text()
        if len(marker) >= 4 and marker[1] == META and integrity.text_checksum(text) != marker[3]:
            raise ValueError(f"{META} does not match the checksum in {COMPLETE}")
        meta = json.loads(text)
    except (OSError, ValueError) as error:
        raise CorruptCheckpoint(f"checkpoint {path} has no readable {META} ({type(error).__name__}: {error}); "
                                f"it is corrupt: resume from an earlier checkpoint") from None
    problem = meta_fields.field_problem(meta)
    if problem is not None:
        raise CorruptCheckpoint(f"checkpoint {path} has an unusable {META} ({problem}); it is corrupt: resume from "
                                f"an earlier checkpoint")
    step = meta["step"]
    if meta.get("format") not in READABLE_FORMATS:
        raise UserError(f"checkpoint {path} has format {meta.get('format')!r} and step {step}; this dtrain "
                        f"reads formats {READABLE_FORMATS}: convert it or start without --resume")
    return meta


def check_checkpoint(path: Path, model_cfg: LlamaConfig, param_shapes: dict[str, tuple[int, ...]],
                     rank: int = 0, world_size: int = 1) -> tuple[dict, bool]:
    """Everything that can be checked before loading, so that a bad checkpoint is one clear error
    rather than a partial load: the commit marker, the model shape, the checksums (this rank's
    share of the files: every `world_size`-th), the DCP metadata, every shard file and every
    parameter's shape. Returns (meta, whether it holds optimizer state)."""
    meta = read_meta(path)
    problems = integrity.verify(path, meta["files"], rank, world_size) if "files" in meta else []
    if problems:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {'; '.join(problems[:3])}; resume from an "
                                f"earlier checkpoint")
    current = model_shape(model_cfg)
    differ = shape_difference(meta.get("model", {}), current, shape_defaults(model_cfg))
    if differ:
        saved = ",".join(f"{k}={meta.get('model', {}).get(k)}" for k in differ)
        now = ",".join(f"{k}={current[k]}" for k in differ)
        raise UserError(f"checkpoint {path} was saved for a model with {saved} but this run's model has {now}; "
                        f"set --model/--model-overrides to the checkpoint's shape or start without --resume")
    try:
        metadata = reader.read_metadata(path)
        storage_data = dict(metadata.storage_data or {})
        saved_tensors = dict(metadata.state_dict_metadata)
    except reader.UntrustedCheckpoint:
        raise
    except Exception as error:  # an unpickler fed damaged bytes can raise almost anything
        raise CorruptCheckpoint(f"checkpoint {path} has no readable DCP .metadata ({type(error).__name__}); "
                                f"it is corrupt: resume from an earlier checkpoint") from None
    for info in storage_data.values():
        shard = path / info.relative_path
        if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
            what = "missing" if not shard.is_file() else "truncated"
            raise CorruptCheckpoint(f"checkpoint {path}: shard file {info.relative_path} is {what}; the "
                                    f"checkpoint is corrupt: resume from an earlier one")
    for name, shape in param_shapes.items():
        entry = saved_tensors.get(f"model.{name}")
        size = tuple(getattr(entry, "size", ()) or ())
        if size != tuple(shape):
            raise UserError(f"checkpoint {path}: parameter {name} has shape {list(size) or 'none'} but the model "
                            f"needs {list(shape)}; it was saved for another model: check --model-overrides")
    has_optim = any(key.startswith("optim.") for key in saved_tensors)
    if not has_optim and meta["step"] != 0:
        raise CorruptCheckpoint(f"checkpoint {path} at step {meta['step']} holds no optimizer state; "
                        f"it is corrupt: resume from an earlier checkpoint")
    return meta, has_optim


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """meta.json, then the COMPLETE marker that holds its checksum."""
    text = json.dumps(meta, indent=1)
    _write_synced(path / META, text)
    _write_synced(path / COMPLETE, f"{meta['step']}\n{META} crc32 {integrity.text_checksum(text)}\n")


def commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank finished writing into `tmp`: the metadata, the marker (with the
    metadata's checksum), the rename."""
    if "files" not in meta:  # a writer in one process (an import): hash everything here
        meta = {**meta, "files": integrity.manifest(tmp, [])}
    write_meta(tmp, meta)
    old = final.with_name(final.name + ".old")
    if final.exists() and not (final / COMPLETE).is_file():
        # Not a checkpoint: never replaced. An empty directory gives way (rmdir removes nothing else).
        try:
            final.rmdir()
        except OSError:
            raise UserError(f"{final} exists and is not a checkpoint; it is left as it is: save into a "
                            f"directory that does not exist yet") from None
    if final.exists():  # a run resumed from an earlier step saves this step again
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _sync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def space_problem(root: Path, step: int, tmp: Path, error: BaseException, *, remove: bool) -> str | None:
    """The line for a save of `step` into `root` that `error` stopped for want of space (None for any
    other error); `remove` (one rank) deletes the failed save, whose space lets the failure be recorded
    and leaves a restart no leftover."""
    if not integrity.out_of_space(root, error):
        return None
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    found = valid_checkpoints(root)
    kept = f"{found[-1][1].name} stays the latest" if found else "there is no earlier checkpoint"
    return (f"the checkpoint of step {step} could not be written: no space is left on the device of {root}; "
            f"{kept}: free space there (or keep fewer with --keep-last), then continue with --resume")


def prune(root: Path, keep_last: int) -> None:
    """Keeps the newest `keep_last` committed checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return
    for _, path in valid_checkpoints(root)[:-keep_last]:
        # Renamed first: a kill during the delete must not leave a half-deleted "valid" checkpoint.
        doomed = path.with_name(path.name + ".old")
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


@attrs.define
class PendingSave:
    future: Any  # its result: the checksums of the files this rank wrote
    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    started: float


def all_ranks_max(values: list[int]) -> list[int]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    # A CPU tensor: gloo on CPU runs, the cpu:gloo side of the process group on GPUs, no device sync.
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def broadcast_from_main(value: Any) -> Any:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def elapsed(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"
