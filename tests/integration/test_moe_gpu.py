"""Routed blocks on a GPU (marked gpu; skipped without CUDA): a compiled block's forward and
backward with no device-to-host synchronisation (torch.cuda.set_sync_debug_mode("error") raises at
any), with bf16 experts, FP8 experts and capacity-factor dropping; and torchao's FP8 grouped GEMM
against the emulation the CPU runs (tests/integration/test_fp8_experts.py checks the emulation's recipe).

    python -m pytest -m gpu tests/integration/test_moe_gpu.py -v
"""

from __future__ import annotations

import pytest

from tests.unit.test_moe_gpu import SHAPE, _needs_fp8

pytestmark = pytest.mark.gpu


def test_fp8_experts_train_beside_bf16_experts(tmp_path):
    """A few compiled steps of a small MoE on one GPU: FP8 experts' losses within 2% of bf16's."""
    _needs_fp8()
    from tests.launch import run_cli, scalars

    common = ["--model", "tiny-moe", "--model-overrides", SHAPE, "--seq-len", "512", "--micro-batch", "4",
              "--steps", "8", "--compile", "--precision", "bf16", "--data", "synthetic"]
    losses = {}
    for name, extra in (("bf16", []), ("fp8", ["--fp8-experts"])):
        run_dir = tmp_path / name
        result = run_cli([*common, *extra, "--run-dir", str(run_dir)])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = scalars(run_dir)["train/loss"]
    for step, (a, e) in enumerate(zip(losses["fp8"], losses["bf16"]), 1):
        assert abs(a - e) <= 0.02 * abs(e), f"step {step}: FP8 experts {a} vs bf16 {e}"
