"""A checkpoint written by an earlier dtrain still loads and continues bit for bit: the format
does not depend on where the code that wrote it lived."""

import json
import shutil

from tests.launch import REPO, run_cli, scalars

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_format1"
# The arguments of the run that wrote the fixture (its README).
ARGS = ["--model", "tiny", "--model-overrides", "dim=16,num_heads=2,num_kv_heads=1,ffn_dim=32,vocab_size=64,num_layers=2",
        "--data", "synthetic", "--steps", "4", "--seq-len", "16", "--micro-batch", "2", "--global-batch", "2",
        "--precision", "fp32", "--lr", "1e-2", "--warmup-steps", "1"]


def test_a_format_1_checkpoint_resumes_to_the_losses_its_run_logged(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "step_000002", run_dir / "checkpoints" / "step_000002")
    result = run_cli([*ARGS, "--run-dir", str(run_dir), "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "at step 2" in result.stdout
    logged = scalars(run_dir)
    expected = json.loads((FIXTURE / "after_resume.json").read_text())
    for tag, by_step in expected.items():
        assert logged[tag] == [by_step["3"], by_step["4"]], tag
