"""Hugging Face files as a hostile source would hand them over: import and export never delete
what they did not write, an export replaces only its own earlier export, an index cannot name
files outside its directory, and a tensor or config.json that is not what a model needs is a
one-line error naming it, before anything is written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dtrain.interop import hf
from models.errors import UserError
from tests.unit.test_hf_convert import make_hf_mixtral, make_hf_model
from tools import hf_convert
from safetensors.torch import load_file, save_file  # noqa: E402  (a dependency of transformers)


pytest.importorskip("transformers")


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


def _edited(source: Path, tmp_path: Path, edit) -> Path:
    """A copy of `source` with `edit(tensors)` applied to its one safetensors file."""
    path = tmp_path / "edited"
    shutil.copytree(source, path)
    tensors = load_file(path / hf.SINGLE_FILE)
    edit(tensors)
    save_file(tensors, path / hf.SINGLE_FILE, metadata={"format": "pt"})
    return path


def _edited_config(source: Path, tmp_path: Path, **fields) -> Path:
    path = tmp_path / "config_edited"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


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


def test_a_commit_replaces_only_a_checkpoint(tmp_path):
    """The cause: a commit renamed whatever stood at the final path aside and deleted it."""
    from dtrain.checkpoint import storage

    meta = {"format": storage.FORMAT_VERSION, "step": 0}
    final = tmp_path / "target"
    final.mkdir()
    (final / "notes.txt").write_text("keep me")
    tmp = tmp_path / "new"
    tmp.mkdir()
    (tmp / "weights").write_bytes(b"w")
    with pytest.raises(UserError, match="exists and is not a checkpoint; it is left as it is"):
        storage.commit(tmp, final, meta)
    assert _tree(final) == {"notes.txt": b"keep me"}
    (final / "notes.txt").unlink()  # an empty directory gives way
    storage.commit(tmp, final, meta)
    assert (final / storage.COMPLETE).is_file() and (final / "weights").read_bytes() == b"w"


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
    _, _, params_b, _ = hf_convert._read_newest(b)
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


def test_a_target_under_a_file_and_a_shard_size_that_is_no_size_are_one_line(hf_dir, two_checkpoints, tmp_path,
                                                                            capsys):
    (a, _), _ = two_checkpoints
    (tmp_path / "a file").write_text("keep me")
    under = str(tmp_path / "a file" / "out")
    _refused(["import", str(hf_dir), under], capsys, "cannot write beside", "pass a path in a directory you can write")
    _refused(["export", str(a), under], capsys, "cannot write beside")
    for size in ("nan", "0", "-1"):
        _refused(["export", str(a), str(tmp_path / "out"), "--max-shard-gb", size], capsys,
                 f"--max-shard-gb {float(size)} must be a positive number of GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a file"]


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_naming_a_file_outside_the_directory_is_refused(sharded_hf_dir, tmp_path, where):
    source = tmp_path / "hf"
    shutil.copytree(sharded_hf_dir, source)
    index = json.loads((source / hf.INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere" / shard
    outside.parent.mkdir()
    shutil.copy(source / shard, outside)  # a loadable file, so that only the path makes it wrong
    named = f"../elsewhere/{shard}" if where == "parent" else str(outside)
    index["weight_map"] = {key: named if value == shard else value for key, value in index["weight_map"].items()}
    (source / hf.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"names {named!r}, outside {source}") as caught:
        hf.HFCheckpoint(source)
    assert "\n" not in str(caught.value)


def test_index_of_another_shape_or_naming_the_wrong_shard_is_one_line(sharded_hf_dir, tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(sharded_hf_dir, source)
    index = json.loads((source / hf.INDEX_FILE).read_text())
    for weight_map, message in ((["model.norm.weight"], "weight_map is not an object"),
                                ({**index["weight_map"], "model.norm.weight": 5}, "names 5 for model.norm.weight")):
        (source / hf.INDEX_FILE).write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(UserError, match=message):
            hf.HFCheckpoint(source)
    files = sorted(set(index["weight_map"].values()))
    moved = next(name for name, file in index["weight_map"].items() if file != files[0])
    (source / hf.INDEX_FILE).write_text(json.dumps({**index, "weight_map": {**index["weight_map"], moved: files[0]}}))
    with pytest.raises(UserError, match=rf"{hf.INDEX_FILE} places {moved} in {files[0]}, which does not hold it"):
        hf_convert.load_hf_params(source)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn], ids=str)
def test_a_tensor_that_is_not_floating_point_is_refused(hf_dir, tmp_path, dtype):
    name = "model.layers.0.mlp.gate_proj.weight"
    source = _edited(hf_dir, tmp_path, lambda t: t.update({name: (t[name] * 100).to(dtype)}))
    for read in (lambda: hf_convert.import_hf(source, tmp_path / "out"), lambda: hf_convert.load_hf_params(source)):
        with pytest.raises(UserError, match=rf"{source / hf.SINGLE_FILE}: {name} holds {str(dtype).split('.')[1]} "
                                            rf"values; dtrain imports floating-point weights") as caught:
            read()
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_tensor_with_non_finite_values_is_refused(hf_dir, tmp_path, value):
    name = "model.layers.1.self_attn.k_proj.weight"

    def poison(tensors):
        tensors[name][3, 5] = value
        tensors[name][7, 1] = value

    source = _edited(hf_dir, tmp_path, poison)
    with pytest.raises(UserError, match=rf"{source / hf.SINGLE_FILE}: {name} holds 2 NaN or infinite values; "
                                        rf"the checkpoint is damaged") as caught:
        hf_convert.import_hf(source, tmp_path / "out")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["edited"]


@pytest.mark.parametrize("fields,message", [
    ({"num_attention_heads": 0}, "num_attention_heads=0, which must be a positive integer"),
    ({"hidden_size": "32"}, "hidden_size='32', which must be a positive integer"),
    ({"hidden_size": None}, "hidden_size=None, which must be a positive integer"),
    ({"vocab_size": 97.5}, "vocab_size=97.5, which must be a positive integer"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps='x', which must be a number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false', which must be true or false"),
    ({"rope_parameters": [1]}, "rope_parameters=\\[1\\], which must be an object"),
])
def test_config_json_of_the_wrong_types_is_one_line(hf_dir, tmp_path, fields, message):
    source = _edited_config(hf_dir, tmp_path, **fields)
    with pytest.raises(UserError, match=rf"{source}: config.json has {message}") as caught:
        hf.HFCheckpoint(source)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("fields,message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "model rope_theta=0.0 must be a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1e4}}, "rope_theta=-10000.0 must be a positive"),
    ({"rms_norm_eps": -1e-5}, "model norm_eps=-1e-05 must be a positive number"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 0, "low_freq_factor": 1,
                          "high_freq_factor": 4, "original_max_position_embeddings": 64}},
     "model rope_scaling factor=0.0 must be a positive number"),
])
def test_settings_that_make_the_first_step_nan_are_one_line(hf_dir, tmp_path, fields, message):
    """Of the right kind, but 0 or negative where RoPE divides by them or the norms take a square
    root: imported, then every loss was NaN."""
    source = _edited_config(hf_dir, tmp_path, **fields)
    with pytest.raises(UserError, match=message) as caught:
        hf.HFCheckpoint(source)
    assert "\n" not in str(caught.value)


def test_a_family_checks_its_own_keys(tmp_path):
    make_hf_mixtral(tmp_path / "mixtral")
    source = _edited_config(tmp_path / "mixtral", tmp_path, num_experts_per_tok=0)
    with pytest.raises(UserError, match="config.json has num_experts_per_tok=0, which must be a positive integer"):
        hf.HFCheckpoint(source)


def test_config_json_that_is_not_an_object_is_one_line(hf_dir, tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(hf_dir, source)
    (source / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"config.json holds a list, not an object of model settings"):
        hf.HFCheckpoint(source)


def test_init_from_hf_refuses_the_same_tensors(hf_dir, tmp_path):
    """--init-from-hf reads through HFCheckpoint.tensor too: a NaN is refused there, not trained on."""
    name = "model.norm.weight"
    source = _edited(hf_dir, tmp_path, lambda t: t[name].__setitem__(0, float("nan")))
    with pytest.raises(UserError, match=rf"{name} holds 1 NaN or infinite value;"):
        hf.HFCheckpoint(source).tensor("head.norm")
    assert os.path.isdir(source)
