"""Reading a checkpoint without trusting it.

torch DCP keeps a checkpoint's index in `.metadata`, a pickle, and non-tensor entries of the
state (the optimizer's hyperparameters: lr, betas ...) as pickles inside the shard files; torch
reads both with Python's full unpickler, so a checkpoint could run any code when it is loaded,
and its index could name files anywhere. Checksums do not help: whoever can write a checkpoint
can rewrite them. Here:

- `.metadata` goes through an unpickler that admits only the classes torch's checkpoint writer
  puts there (DCP's metadata records, torch.Size, dtypes and layouts, paths);
- the non-tensor entries go through torch's weights-only unpickler (numbers, strings, tuples);
- every file the index names must lie inside the checkpoint directory, and no symbolic link in
  it may lead outside (`check_links`, which the reading of meta.json starts with).

Anything else is refused in one line that names the file, before a byte of it is used.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from models.errors import UserError

METADATA = ".metadata"
_RECORDS = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
# What torch 2.11-2.13 write into `.metadata` (module -> names); torch's own dtypes and layouts
# are admitted by type below. Python 3.13 moved pathlib's classes to pathlib._local.
ADMITTED = {
    "torch.distributed.checkpoint.metadata": frozenset(_RECORDS),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset(_PATHS),
    "pathlib._local": frozenset(_PATHS),
    "collections": frozenset({"OrderedDict"}),
}
_ADVICE = ("refused without loading it: the file was altered or not written by torch's checkpoint; load "
           "checkpoints only from sources you trust")


class UntrustedCheckpoint(UserError):
    """A checkpoint that holds what torch's checkpoint writer never writes: code to run, or a path
    outside the checkpoint. Refused, never fallen back from: someone changed it."""


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ADMITTED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def inside(directory: Path, relative: Any) -> bool:
    """Whether `relative` names a path under `directory` (symbolic links followed)."""
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute():
        return False
    root = Path(directory).resolve()
    return (root / relative).resolve().is_relative_to(root)


def check_links(path: Path) -> None:
    """Every file and folder under the checkpoint at `path` lies inside it: a symbolic link to
    elsewhere would have a load read another file than the checkpoint's own (its weights, its
    meta.json, its RNG states). Links within the checkpoint stay allowed."""
    root = Path(path).resolve()
    for folder, folders, files in os.walk(path):  # a linked folder is checked here, not entered
        for name in folders + files:
            entry = Path(folder) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(root):
                raise UntrustedCheckpoint(f"checkpoint {path}: {entry.relative_to(path)} is a symbolic link to "
                                          f"{os.readlink(entry)}, outside the checkpoint directory; {_ADVICE}")


def read_metadata(path: Path) -> Metadata:
    """The DCP index of the checkpoint at `path`, read through the restricted unpickler and
    checked: UntrustedCheckpoint for anything torch would not have written; other exceptions
    (OSError, a damaged pickle) are the caller's to report as damage."""
    path = Path(path)
    with open(path / METADATA, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except _Refused as refused:
            raise UntrustedCheckpoint(f"checkpoint {path}: {METADATA} holds a pickled {refused}, which torch's "
                                      f"checkpoint never writes; {_ADVICE}") from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpoint(f"checkpoint {path}: {METADATA} holds a {type(metadata).__name__}, not torch's "
                                  f"checkpoint metadata; {_ADVICE}")
    check_storage(path, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def check_storage(path: Path, metadata: Metadata) -> None:
    """Where the index places each tensor: a file inside the checkpoint, at an offset and length
    that are whole numbers (torch writes nothing else there)."""
    for info in dict(metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not inside(path, relative):
            raise UntrustedCheckpoint(f"checkpoint {path}: {METADATA} names the file {relative!r}, outside the "
                                      f"checkpoint directory; {_ADVICE}")
        for name in ("offset", "length"):
            value = getattr(info, name, None)
            if type(value) is not int or value < 0:
                raise UntrustedCheckpoint(f"checkpoint {path}: {METADATA} places a tensor of {relative} at {name} "
                                          f"{value!r}, which torch's checkpoint never writes; {_ADVICE}")


class CheckpointReader(FileSystemReader):
    """DCP's file reader with the index read once, through `read_metadata`, when it is made (a
    refusal is then one line, not a warning with a traceback inside DCP's load)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.checked = read_metadata(Path(path))

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to another index
        self.checked.storage_meta.load_id = self.load_id
        return self.checked

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        check_storage(Path(self.path), metadata)  # the index may come from another rank
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by the weights-only unpickler."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item, value) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            info = dict(self.metadata.storage_data or {}).get(read_item.storage_index)
            where = getattr(info, "relative_path", "a shard file")
            first = (str(error).strip().splitlines() or [""])[0][:160]
            raise UntrustedCheckpoint(f"checkpoint {self.path}: the entry {read_item.dest_index.fqn} in {where} is "
                                      f"not plain data ({first}); {_ADVICE}") from None
        # As DefaultLoadPlanner.load_bytes places it, which unpickles with weights_only=False.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state: dict[str, Any], path: Path, *, no_dist: bool = False) -> None:
    """dcp.load of `state` from the checkpoint at `path`, through the checks above. Raises
    UntrustedCheckpoint, or DCP's CheckpointException for damage."""
    path = Path(path)
    try:
        dcp.load(state, storage_reader=CheckpointReader(path), planner=CheckpointLoadPlanner(path), no_dist=no_dist)
    except dcp.api.CheckpointException as error:
        for failure in error.failures.values():
            refused = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(refused, UntrustedCheckpoint):
                raise UntrustedCheckpoint(str(refused)) from None
        raise
