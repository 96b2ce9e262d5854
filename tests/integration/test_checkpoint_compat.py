"""A checkpoint written by an earlier dtrain still loads and continues to the losses its run
logged: the format does not depend on where the code that wrote it lived. Format 1 has no
checksums: it loads unverified (the log says so), and a damaged .metadata in it is still one clear
line."""

import json
import shutil

import pytest

from tests.launch import run_cli, scalars
from tests.unit.test_checkpoint_compat import FIXTURE, ARGS


def test_a_format_1_checkpoint_resumes_to_the_losses_its_run_logged(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "step_000002", run_dir / "checkpoints" / "step_000002")
    result = run_cli([*ARGS, "--run-dir", str(run_dir), "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "at step 2" in result.stdout
    assert "holds no checksums (written before format 2): its files are not verified" in result.stdout
    logged = scalars(run_dir)
    expected = json.loads((FIXTURE / "after_resume.json").read_text())
    # Within float rounding, not bit for bit: the fixture was written on another machine, and CPUs
    # of other vector widths (AVX2, AVX-512) round fp32 sums differently (1e-7 apart). A checkpoint
    # that lost its optimizer state or a tensor would be off by far more.
    for tag, by_step in expected.items():
        assert logged[tag] == pytest.approx([by_step["3"], by_step["4"]], rel=1e-5, abs=1e-7), tag
