"""Hugging Face files as a hostile source would hand them over: import and export never delete
what they did not write, and an export replaces only its own earlier export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dtrain.interop import hf
from models.errors import UserError
from tests.test_hf_convert import make_hf_model
from tools import hf_convert

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (a dependency of transformers)


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes: what a refused command must leave unchanged."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys, *fragments: str) -> str:
    assert hf_convert.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf_convert: error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "model"
    make_hf_model(path)
    return path


@pytest.fixture(scope="module")
def sharded_hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "sharded"
    make_hf_model(path, max_shard_size="20KB")
    return path


# ---- import: the target ---------------------------------------------------------------------------

def test_import_into_a_run_directory_is_refused_and_deletes_nothing(hf_dir, tmp_path, capsys):
    run = tmp_path / "run"
    hf_convert.import_hf(hf_dir, run / "checkpoints" / "step_000000")
    (run / "train.log").write_text("step 1 | loss 4.1\n")
    (run / "events.out.tfevents.1.host").write_bytes(b"\x00tb")
    (run / "notes.txt").write_text("keep me")
    before = _tree(run)
    # Its step_000000 is taken: the suggestion is a new run's.
    _refused(["import", str(hf_dir), str(run)], capsys, f"{run} is a run directory",
             f"such as {tmp_path / 'run-imported' / 'checkpoints' / 'step_000000'}")
    assert _tree(run) == before
    # Any other directory with files in it is not the import's to replace either.
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    _refused(["import", str(hf_dir), str(other)], capsys, f"{other} is not empty", "mine.txt")
    assert _tree(other) == {"mine.txt": b"keep me"}


def test_import_writes_into_an_empty_directory_and_leaves_a_neighbour_alone(hf_dir, tmp_path):
    target = tmp_path / "step_000000"
    target.mkdir()
    neighbour = tmp_path / "step_000000.tmp"  # not the import's: a temporary name must not be guessed
    neighbour.mkdir()
    (neighbour / "mine.txt").write_text("keep me")
    assert hf_convert.import_hf(hf_dir, target) == target
    assert (target / "COMPLETE").is_file()
    assert _tree(neighbour) == {"mine.txt": b"keep me"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000", "step_000000.tmp"]


# ---- export: the target ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Two imported checkpoints of one shape with different weights, and each source's tensors."""
    root = tmp_path_factory.mktemp("two")
    found = []
    for name, seed in (("a", 1), ("b", 2)):
        source = root / f"hf_{name}"
        make_hf_model(source)
        tensors = load_file(source / hf.SINGLE_FILE)
        generator = torch.Generator().manual_seed(seed)
        tensors = {key: torch.randn(value.shape, generator=generator) for key, value in tensors.items()}
        save_file(tensors, source / hf.SINGLE_FILE, metadata={"format": "pt"})
        found.append((hf_convert.import_hf(source, root / name / "step_000000"), tensors))
    return found


def _exported(path: Path) -> dict[str, torch.Tensor]:
    source = hf.HFCheckpoint(path)
    return {name: source.tensor(name) for name in source.shapes}


@pytest.mark.parametrize("first,second", [(1000, 1 << 30), (1 << 30, 1000)], ids=["sharded-then-one", "one-then-sharded"])
def test_export_replaces_its_own_earlier_export_whole(two_checkpoints, tmp_path, first, second):
    (a, _), (b, _) = two_checkpoints
    out = tmp_path / "out"
    hf_convert.export_hf(a, out, max_shard_bytes=first)
    hf_convert.export_hf(b, out, max_shard_bytes=second)
    files = sorted(p.name for p in out.iterdir())
    sharded = second < (1 << 30)
    assert (hf.INDEX_FILE in files) == sharded and (hf.SINGLE_FILE in files) != sharded, files
    if sharded:
        named = set(json.loads((out / hf.INDEX_FILE).read_text())["weight_map"].values())
        assert set(files) == named | {hf.INDEX_FILE, "config.json"}, files
    written = _exported(out)
    _, params_b, _ = hf_convert.read_dtrain_params(b)
    assert written.keys() == params_b.keys()
    for name in written:
        assert torch.equal(written[name], params_b[name]), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left


def test_export_refuses_a_directory_it_did_not_write(two_checkpoints, hf_dir, tmp_path, capsys):
    (a, _), _ = two_checkpoints
    downloaded = tmp_path / "downloaded"
    shutil.copytree(hf_dir, downloaded)  # config.json + model.safetensors, written by transformers
    before = _tree(downloaded)
    _refused(["export", str(a), str(downloaded)], capsys, f"{downloaded} holds files that no export of "
             f"dtrain wrote", "pass a new directory")
    assert _tree(downloaded) == before
    # An earlier export with a file the user added beside it.
    out = tmp_path / "out"
    hf_convert.export_hf(a, out)
    (out / "tokenizer.json").write_text("{}")
    before = _tree(out)
    _refused(["export", str(a), str(out)], capsys, "tokenizer.json")
    assert _tree(out) == before
