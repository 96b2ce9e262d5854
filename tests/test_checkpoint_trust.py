"""What a checkpoint may not do to the process that loads it: run code (torch DCP's `.metadata`
and its non-tensor entries are pickles) or make it read files outside the checkpoint. Each case is
a real hostile checkpoint, with its checksums recomputed as its author would."""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dtrain.checkpoint import reader
from dtrain.checkpoint import storage as ckpt
from dtrain.run import main
from tests.damage import resign
from tests.launch import TINY_ARGS
from tools import hf_convert


class RunsACommand:
    """Unpickled, it runs a shell command (here: creates a marker file)."""

    def __init__(self, marker: Path):
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self):
        return os.system, (self.command,)


def _copy(reference, tmp_path: Path) -> Path:
    target = tmp_path / "step_000003"
    shutil.copytree(reference[0] / ckpt.CHECKPOINTS / "step_000003", target)
    return target


def _rewrite_metadata(path: Path, change) -> None:
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the project's own file, written by the reference run
    change(metadata)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    resign(path)


def _resume(path: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code = main([*TINY_ARGS, "--steps", "4", "--run-dir", str(tmp_path / "run"), "--resume", str(path)])
    return code, capsys.readouterr().err.strip()


def _export(path: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code = hf_convert.main(["export", str(path), str(tmp_path / "hf")])
    return code, capsys.readouterr().err.strip()


def test_a_metadata_pickle_that_runs_a_command_is_refused_by_resume_and_export(reference, tmp_path, capsys):
    path = _copy(reference, tmp_path)
    marker = tmp_path / "ran"
    # The command runs while the index is unpickled, and the real metadata comes back after it.
    _rewrite_metadata(path, lambda metadata: setattr(metadata.storage_meta, "modules", [RunsACommand(marker)]))
    for command in (_resume, _export):
        code, err = command(path, tmp_path, capsys)
        assert not marker.exists(), f"{command.__name__} ran the checkpoint's command"
        assert code == 2 and "\n" not in err, err
        assert f"checkpoint {path}: .metadata holds a pickled {os.system.__module__}.system" in err and "refused" in err, err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_non_tensor_entry_that_runs_a_command_is_refused(reference, tmp_path, capsys):
    """DCP keeps the optimizer's hyperparameters as pickles in the shard files and reads them
    with the full unpickler; here one of them runs a command."""
    source = reference[0] / ckpt.CHECKPOINTS / "step_000003"
    dcp_to_torch_save(source, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)  # the project's own file
    marker = tmp_path / "ran"
    state["optim"]["param_groups.head.output.lr"] = RunsACommand(marker)
    path = tmp_path / "step_000003"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    shutil.copytree(source / "rng", path / "rng")
    shutil.copy(source / ckpt.META, path / ckpt.META)
    resign(path)
    code, err = _resume(path, tmp_path, capsys)
    assert not marker.exists(), "the resume ran the checkpoint's command"
    assert code == 2 and "\n" not in err, err
    assert f"checkpoint {path}: the entry optim.param_groups.head.output.lr in __0_0.distcp is not plain data" in err


@pytest.mark.parametrize("where", ["../outside/__0_0.distcp", "absolute"])
def test_a_metadata_naming_a_file_outside_the_checkpoint_is_refused(reference, tmp_path, capsys, where):
    path = _copy(reference, tmp_path)
    outside = tmp_path / "outside" / "__0_0.distcp"
    outside.parent.mkdir()
    shutil.move(path / "__0_0.distcp", outside)  # the data is there: a load would read it
    named = str(outside) if where == "absolute" else where

    def point_outside(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = named

    _rewrite_metadata(path, point_outside)
    for command in (_resume, _export):
        code, err = command(path, tmp_path, capsys)
        assert code == 2 and "\n" not in err, err
        assert f"names the file {named!r}, outside the checkpoint directory" in err, err


def test_every_checkpoint_the_project_writes_passes_the_restricted_unpickler(reference, tmp_path):
    for _, path in ckpt.valid_checkpoints(reference[0] / ckpt.CHECKPOINTS):
        with open(path / ".metadata", "rb") as f:
            assert reader.read_metadata(path) .state_dict_metadata.keys() == pickle.load(f).state_dict_metadata.keys()
