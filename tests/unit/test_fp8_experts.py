"""FP8 experts (parallel/fp8_experts.py) on CPU, where their casts are emulated: the aligned row
layout; the grouped GEMM's three products against the recipe written out per expert (each operand
scaled by a power of two along the dim its product sums over, rounded to float8 e4m3); padding
that changes nothing; and a few training steps beside the bf16 experts. tests/unit/test_moe_gpu.py
compares the emulation with torchao's kernels on a GPU."""

from __future__ import annotations

import pytest
import torch

from dtrain.layout import Machine
from models.config import ClampedSwiGLU
from models.context import ExpertBiases, grouped_swiglu
from models.errors import UserError
from parallel.fp8_experts import ALIGN, AlignedRows, Fp8GroupedExperts, _EmulatedRowwiseGroupedMM, check_shapes
from tests.layouts import resolved


COUNTS = torch.tensor([5, 0, 17, 16, 1])  # an empty group, one of exactly 16, odd ones


def _float8(t: torch.Tensor, dim) -> torch.Tensor:
    """The recipe by its definition: per slice along `dim`, scale = 2^floor(log2(448 / amax))."""
    amax = t.abs().amax(dim, keepdim=True).clamp_min(1e-12)
    scale = 2.0 ** torch.floor(torch.log2(448.0 / amax))
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


def test_each_expert_starts_at_a_multiple_of_16_and_the_rows_come_back():
    rows = int(COUNTS.sum()) + 3  # three uncounted rows at the end
    layout = AlignedRows(COUNTS, rows)
    x = torch.randn(rows, 4)
    padded = layout.pad(x)
    starts = torch.cumsum(layout.counts, 0) - layout.counts
    assert layout.counts.tolist() == [16, 0, 32, 16, 16] and layout.rows % ALIGN == 0
    assert (starts % ALIGN == 0).all()
    ends = torch.cumsum(COUNTS, 0) - COUNTS
    for expert, (start, count) in enumerate(zip(starts.tolist(), COUNTS.tolist())):
        first = int(ends[expert])
        torch.testing.assert_close(padded[start:start + count], x[first:first + count])
        assert not padded[start + count:start + int(layout.counts[expert])].any()  # zero padding
    assert (layout.positions[-3:] >= int(layout.counts.sum())).all()  # after every group
    torch.testing.assert_close(layout.unpad(padded), x)


def test_the_grouped_gemm_and_its_gradients_follow_the_recipe_per_expert():
    generator = torch.Generator().manual_seed(0)
    experts, n, k = 5, 32, 48
    layout = AlignedRows(COUNTS, int(COUNTS.sum()))
    x = layout.pad(torch.randn(int(COUNTS.sum()), k, generator=generator) * 3).requires_grad_()
    w = (torch.randn(experts, n, k, generator=generator) * 0.1).requires_grad_()
    grad = torch.randn(layout.rows, n, generator=generator)
    offs = torch.cumsum(layout.counts, 0, dtype=torch.int32)
    out = _EmulatedRowwiseGroupedMM.apply(x, w, offs)
    out.backward(grad)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end == start:
            assert not w.grad[e].any()
            continue
        rows, g = x.detach()[start:end], grad[start:end]
        torch.testing.assert_close(out[start:end], _float8(rows, 1) @ _float8(w.detach()[e], 1).T)
        torch.testing.assert_close(x.grad[start:end], _float8(g, 1) @ _float8(w.detach()[e], 0))
        # Both operands of the weight gradient scaled per column over the expert's rows.
        torch.testing.assert_close(w.grad[e], _float8(g, 0).T @ _float8(rows, 0))
        start = end
    # The casts did something: FP8 products differ from the exact ones.
    assert not torch.allclose(out[:16], x.detach()[:16] @ w.detach()[0].T, rtol=1e-3)


def test_padding_to_aligned_groups_changes_no_value_or_gradient():
    """Zero rows change no row's scale nor any column's amax within a group: the aligned FP8
    experts equal the same emulated GEMMs on the unpadded rows, variants and uncounted rows too."""
    generator = torch.Generator().manual_seed(1)
    e, f, d = len(COUNTS), 32, 16
    rows = int(COUNTS.sum()) + 2
    inputs = [torch.randn(rows, d, generator=generator) * 3, torch.randn(e, f, d, generator=generator) * 0.3,
              torch.randn(e, f, d, generator=generator) * 0.3, torch.randn(e, d, f, generator=generator) * 0.3,
              torch.randn(e, f, generator=generator), torch.randn(e, f, generator=generator),
              torch.randn(e, d, generator=generator)]
    grad = torch.randn(rows, d, generator=generator)
    results = []
    for aligned in (True, False):
        leaves = [t.clone().requires_grad_() for t in inputs]
        x, weights, biases = leaves[0], leaves[1:4], ExpertBiases(*leaves[4:])
        if aligned:
            out = Fp8GroupedExperts(native=False)(x, COUNTS, *weights, biases=biases, glu=ClampedSwiGLU())
        else:
            out = grouped_swiglu(x, COUNTS, *weights, biases=biases, glu=ClampedSwiGLU(),
                                 mm=_EmulatedRowwiseGroupedMM.apply)
        counted = int(COUNTS.sum())
        out[:counted].backward(grad[:counted])  # the uncounted rows' outputs are unspecified
        # The uncounted rows' gradients are unspecified too: the callers mask those rows.
        results.append([out[:counted], x.grad[:counted], *(t.grad for t in leaves[1:])])
    for name, aligned, plain in zip(("out", "dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down"),
                                    *results):
        torch.testing.assert_close(aligned, plain, rtol=1e-6, atol=1e-6, msg=name)


def test_shapes_fp8_cannot_multiply_are_refused():
    check_shapes(2048, 1408)
    with pytest.raises(UserError, match=r"expert_ffn_dim 1400\) to be multiples of 16; \[1400\]"):
        check_shapes(2048, 1400)


def test_the_layout_says_which_experts_run_in_fp8_and_by_which_kernel():
    """torchao's grouped GEMMs with or without --fp8, emulated where the machine has no FP8 GEMMs;
    Transformer Engine's beside its FP8 matmuls; the blocks FP8 covers."""
    alone = resolved(["--model", "tiny-moe", "--fp8-experts"]).parallel
    assert alone.fp8 is None and (alone.fp8_experts.backend, alone.fp8_experts.emulated) == ("torchao", True)
    assert alone.fp8_experts.layers == frozenset(f"blocks.{i}" for i in range(4))
    on_h200 = resolved(["--model", "tiny-moe", "--fp8-experts", "--fp8", "rowwise", "--precision", "bf16",
                        "--fp8-keep-ends"], machine=Machine.gpu_profile("h200")).parallel
    assert not on_h200.fp8_experts.emulated and on_h200.fp8_experts.layers == on_h200.fp8.layers == {"blocks.1",
                                                                                                    "blocks.2"}
    assert resolved(["--model", "tiny-moe"]).parallel.fp8_experts is None
