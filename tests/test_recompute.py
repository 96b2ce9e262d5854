"""Activation recompute: every mode trains to the same losses, and selective recompute re-runs the
cheap element-wise ops but never a GEMM, a grouped GEMM, a collective or an FP8 amax."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.context import grouped_swiglu
from parallel import collectives, recompute
from tests.launch import train_scalars

_aten = torch.ops.aten
_ALL_TO_ALL = (torch.ops._c10d_functional.all_to_all_single.default,
               torch.ops._c10d_functional_autograd.all_to_all_single.default)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_selective_recompute_reruns_element_wise_ops_only(one_rank_group):
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm")
    torch.manual_seed(0)
    e, f, d, rows = 3, 16, 8, 10
    counts = torch.tensor([4, 0, 6])

    def block(x, w_in, w_gate, w_up, w_down):
        # A matmul scaled as FP8 scales (tensorwise and rowwise amax), an all-to-all (identity on
        # one rank, as in expert parallelism), the experts' grouped GEMMs.
        h = (x / x.abs().max()) @ w_in
        h = F.silu(h / h.abs().amax(dim=-1, keepdim=True))
        h = collectives.all_to_all(h, None, None, one_rank_group)
        return grouped_swiglu(h, counts, w_gate, w_up, w_down, use_grouped_mm=True)

    inputs = [torch.randn(rows, d), torch.randn(d, d), torch.randn(e, f, d), torch.randn(e, f, d), torch.randn(e, d, f)]
    upstream = torch.randn(rows, d)
    seen, grads = {}, {}
    for mode in recompute.RECOMPUTE_MODES:
        leaves = [t.clone().requires_grad_() for t in inputs]
        with _CountOps() as counter:
            recompute.wrap(block, mode)(*leaves).backward(upstream)
        seen[mode], grads[mode] = counter.counts, [t.grad for t in leaves]

    def calls(mode, *ops):
        return sum(seen[mode][op] for op in ops)

    for mode in ("selective", "full"):
        for a, b in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    expensive = [(_aten.mm.default,), (_aten._grouped_mm.default,), _ALL_TO_ALL, (_aten.max.default,),
                 (_aten.amax.default,)]
    for ops in expensive:
        assert calls("none", *ops) > 0, ops
        assert calls("selective", *ops) == calls("none", *ops), ops  # saved, not recomputed
        assert calls("full", *ops) > calls("none", *ops), ops  # full recompute re-runs them
    assert calls("selective", _aten.silu.default) > calls("none", _aten.silu.default)


@pytest.mark.slow
def test_every_recompute_mode_trains_to_the_same_losses(tmp_path):
    runs = {mode: train_scalars(tmp_path / mode, ["--recompute", mode, "--steps", "4"])
            for mode in recompute.RECOMPUTE_MODES}
    for mode in ("selective", "full"):
        assert len(runs[mode]["train/loss"]) == 4
        for step, (a, e) in enumerate(zip(runs[mode]["train/loss"], runs["none"]["train/loss"]), 1):
            assert abs(a - e) <= 1e-6 * abs(e), f"--recompute {mode} at step {step}: {a} vs {e}"
