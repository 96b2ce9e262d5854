"""The profile breakdown: kernel names as H100/H200 profiles print them, and the attribution of
kernels to the ranges their ops (or, in backward, their forward ops) ran in."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_a_profiled_gpu_run_has_every_part_of_the_step(tmp_path):
    """One GPU, compiled bf16: the breakdown of a real step (kernel names as this GPU's libraries
    print them) has GEMMs, attention, the loss, element-wise work and the optimizer."""
    import json

    from tests.launch import run_cli

    result = run_cli(["--shape", "tiny", "--steps", "8", "--warmup", "4", "--profile", str(tmp_path / "profile"),
                      "--", "--run-dir", str(tmp_path / "run"), "--compile"], module="tools.bench")
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    text = (tmp_path / "profile" / "profile_rank0.txt").read_text()
    for category in ("gemm", "attention", "loss", "elementwise", "optimizer"):
        assert row["profile"]["ms"][category] > 0, (category, text[:4000])
