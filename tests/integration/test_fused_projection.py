"""`linear_many`: the q/k/v and gate/up projections as one matmul on whole weights, the same
numbers as separate matmuls; separate matmuls on DTensor and other tensor-subclass weights."""

import torch
import torch.nn.functional as F

from parallel.precision import Float8Linear
from tests.unit.test_fused_projection import OUTS, _inputs
from tests.unit.test_fused_projection import one_rank_context  # noqa: F401  (a fixture of these tests)


def test_fp8_fused_projections_run_one_fp8_matmul(one_rank_context):
    ctx, _ = one_rank_context
    fp8 = Float8Linear("tensorwise", emulate=True)
    calls = []
    ctx = ctx.with_fp8(lambda x, w: calls.append(w.shape) or fp8(x, w))
    x, weights = _inputs((2, 8, 32))
    out = ctx.linear_many(x, weights)
    assert calls == [(sum(OUTS), 32)]
    assert [o.shape[-1] for o in out] == list(OUTS)
    reference = torch.cat([F.linear(x, w) for w in weights], dim=-1)
    relative = (torch.cat(out, dim=-1) - reference).norm() / reference.norm()
    assert 1e-4 < relative.item() < 0.1, relative
    sum(o.sum() for o in out).backward()
    assert all(w.grad is not None and torch.isfinite(w.grad).all() for w in weights)
