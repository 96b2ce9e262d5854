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
from tests.launch import TINY_ARGS, scalars
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


@pytest.mark.parametrize("linked", ["__0_0.distcp", "rng/rank_00000.pt", "rng", ckpt.META])
def test_a_symbolic_link_that_leads_out_of_the_checkpoint_is_refused(reference, tmp_path, capsys, linked):
    """The file or folder lies outside, a link to it in its place, the checksums recomputed (or,
    for the RNG states, the file left out of them, as the manifest need not list it)."""
    path = _copy(reference, tmp_path)
    outside = tmp_path / "outside" / linked
    outside.parent.mkdir(parents=True)
    shutil.move(path / linked, outside)
    (path / linked).symlink_to(outside)
    if linked != ckpt.META:
        resign(path)
    for command in (_resume, _export):
        code, err = command(path, tmp_path, capsys)
        assert code == 2 and "\n" not in err, err
        assert f"checkpoint {path}: {linked} is a symbolic link to {outside}, outside the checkpoint" in err, err


def test_a_symbolic_link_within_the_checkpoint_is_read(reference, tmp_path, capsys):
    path = _copy(reference, tmp_path)
    shutil.move(path / "__0_0.distcp", path / "rng" / "shard")
    (path / "__0_0.distcp").symlink_to(Path("rng") / "shard")
    resign(path)
    code, err = _resume(path, tmp_path, capsys)
    assert code == 0, err


def _set_files_entry(meta):
    meta["files"][".metadata"] = {"crc32": "00000000"}


META_FIELDS = [
    ("files", lambda meta: meta.update(files=[]), "its files is [], not an object of file names"),
    ("a file's entry", _set_files_entry, "its files entry '.metadata' is {'crc32': '00000000'}, not an object of the "
                                         "file's size and crc32"),
    ("model", lambda meta: meta.update(model=[]), "its model is [], not an object of the model's settings"),
    ("step", lambda meta: meta.update(step="3"), "its step is '3', not a whole number >= 0"),
    ("data position", lambda meta: meta.update(consumed_samples=-8), "its consumed_samples is -8, not a whole number"),
    ("scheduler", lambda meta: meta.update(scheduler=[3]), "its scheduler is [3], not null or the LR schedule's state"),
    ("config", lambda meta: meta.update(config=5), "its config is 5, not a string"),
    ("skips", lambda meta: meta["skips"].update(recent_losses=["nan"]), "its skips is"),
    ("no model", lambda meta: meta.pop("model"), "it has no model"),
]


@pytest.mark.parametrize("change,message", [c[1:] for c in META_FIELDS], ids=[c[0] for c in META_FIELDS])
def test_meta_json_fields_of_the_wrong_kind_are_one_line(reference, tmp_path, capsys, change, message):
    """meta.json with its checksum in COMPLETE recomputed: parsed, but a field of the wrong kind
    (a traceback where a reader met it)."""
    import json

    path = _copy(reference, tmp_path)
    meta = json.loads((path / ckpt.META).read_text())
    change(meta)
    ckpt.write_meta(path, meta)
    for command in (_resume, _export):
        code, err = command(path, tmp_path, capsys)
        assert code == 2 and "\n" not in err, err
        assert f"checkpoint {path} has an unusable meta.json ({message}" in err and "corrupt" in err, err


def test_only_the_schedules_position_is_taken_from_meta_json(reference, tmp_path, capsys):
    """Other keys of the scheduler's state would become attributes of this run's scheduler."""
    import json

    path = _copy(reference, tmp_path)
    meta = json.loads((path / ckpt.META).read_text())
    meta["scheduler"].update(optimizer="replaced", lr_lambdas=[{"x": 1}, 2], base_lrs=[1e9, 1e9])
    ckpt.write_meta(path, meta)
    code, err = _resume(path, tmp_path, capsys)
    assert code == 0, err
    resumed = scalars(tmp_path / "run")
    assert resumed["train/loss"] == reference[1][3:4] and resumed["train/lr"][0] < 1e-3



@pytest.mark.parametrize("field,value", [("offset", "0"), ("offset", -8), ("length", 2.5), ("length", None)])
def test_a_metadata_placing_a_tensor_at_no_whole_offset_is_refused(reference, tmp_path, capsys, field, value):
    """Where torch writes whole byte counts; a string was a TypeError traceback."""
    path = _copy(reference, tmp_path)

    def misplace(metadata):
        for info in metadata.storage_data.values():
            setattr(info, field, value)

    _rewrite_metadata(path, misplace)
    for command in (_resume, _export):
        code, err = command(path, tmp_path, capsys)
        assert code == 2 and "\n" not in err, err
        assert f"checkpoint {path}: .metadata places a tensor of __0_0.distcp at {field} {value!r}" in err, err
