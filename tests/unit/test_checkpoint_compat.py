"""A checkpoint written by an earlier dtrain still loads and continues to the losses its run
logged: the format does not depend on where the code that wrote it lived. Format 1 has no
checksums: it loads unverified (the log says so), and a damaged .metadata in it is still one clear
line."""

import os
import shutil

import pytest

from dtrain.run import main
from tests.damage import same_size_garbage
from tests.launch import REPO


FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_format1"


# The arguments of the run that wrote the fixture (its README).
ARGS = ["--model", "tiny", "--model-overrides", "dim=16,num_heads=2,num_kv_heads=1,ffn_dim=32,vocab_size=64,num_layers=2",
        "--data", "synthetic", "--steps", "4", "--seq-len", "16", "--micro-batch", "2", "--global-batch", "2",
        "--precision", "fp32", "--lr", "1e-2", "--warmup-steps", "1"]


@pytest.mark.parametrize("damage", ["random bytes", "truncation"])
def test_a_damaged_metadata_without_checksums_is_one_line_not_an_unpickling_traceback(tmp_path, capsys, damage):
    checkpoint = tmp_path / "step_000002"
    shutil.copytree(FIXTURE / "step_000002", checkpoint)
    metadata = checkpoint / ".metadata"
    if damage == "random bytes":
        same_size_garbage(metadata)
    else:
        os.truncate(metadata, metadata.stat().st_size // 2)
    code = main([*ARGS, "--run-dir", str(tmp_path / "run"), "--resume", str(checkpoint)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("dtrain: error: ") and "has no readable DCP .metadata" in err, err
