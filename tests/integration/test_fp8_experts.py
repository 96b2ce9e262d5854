"""FP8 experts (parallel/fp8_experts.py) on CPU, where their casts are emulated: the aligned row
layout; the grouped GEMM's three products against the recipe written out per expert (each operand
scaled by a power of two along the dim its product sums over, rounded to float8 e4m3); padding
that changes nothing; and a few training steps beside the bf16 experts. tests/integration/test_moe_gpu.py
compares the emulation with torchao's kernels on a GPU."""

from __future__ import annotations

import pytest

from tests.launch import train_scalars


@pytest.mark.slow
def test_training_with_fp8_experts_stays_beside_bf16_experts(tmp_path):
    """Six steps of tiny-moe with emulated FP8 experts: losses within 1% of the same run's with
    bf16 experts (the casts round each operand by up to 6%), and not equal to them."""
    extra = ["--model", "tiny-moe", "--steps", "6", "--precision", "bf16"]
    plain = train_scalars(tmp_path / "bf16", extra)["train/loss"]
    fp8 = train_scalars(tmp_path / "fp8", [*extra, "--fp8-experts"])["train/loss"]
    assert fp8 != plain
    for step, (a, e) in enumerate(zip(fp8, plain), 1):
        assert abs(a - e) <= 0.01 * abs(e), f"step {step}: FP8 experts {a} vs bf16 experts {e}"
