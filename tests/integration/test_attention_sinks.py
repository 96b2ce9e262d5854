"""Attention sinks: LocalContext's math against transformers' gpt-oss attention, and the fused
forms (a block kernel's out and log-sum-exp rescaled, each kernel's own backward) against that
math, forward and backward (dq, dk, dv and the sinks' gradient), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from models import masking
from models.context import LocalContext, causal_attention
from parallel import masked_attention
from parallel.attention_sinks import attention_with_sinks
from tests.workers.cp_attention import document_ids_of
from tests.unit.test_attention_sinks import _inputs


@pytest.mark.parametrize("masked", [False, True], ids=["fused-kernel", "dense-mask"])
def test_fused_sinks_match_the_math_forward_and_backward(masked):
    q, k, v, sinks, grad = _inputs(1)
    ids = document_ids_of([[7, 11, 6], [24]])
    mask = LocalContext().attention_mask(ids, 6) if masked else None

    def run(attend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = attend(*leaves)
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    expected = run(lambda q, k, v, s: causal_attention(q, k, v, mask, 0.3, s))
    form = None
    if masked:
        first = masking.first_keys(ids, 6)
        form = masked_attention.build_form("dense", ids, first, torch.arange(24), torch.arange(24), 6, torch.device("cpu"))
    actual = run(lambda q, k, v, s: attention_with_sinks(q, k, v, s, form, 0.3))
    for name, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=name)
    assert expected[4].abs().min() > 0  # every head's sink gets a gradient


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["cudnn-or-flash", "flex"])
def test_gpu_sinks_match_the_math_in_bf16(masked):
    cuda = torch.device("cuda")
    q, k, v, sinks, grad = (t.to(cuda) for t in _inputs(2, batch=2, seq=1024, heads=8, kv_heads=2, head_dim=64))
    ids = document_ids_of([[300, 500, 224], [1024]])
    form = None
    if masked:
        first = masking.first_keys(ids, 128)
        form = masked_attention.build_form("flex", ids, first, torch.arange(1024), torch.arange(1024), 128, cuda)
    dense = LocalContext().attention_mask(ids, 128) if masked else None

    def run(attend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out = attend(*leaves)
        out.backward(grad.to(dtype))
        return [out.float(), *(t.grad.float() for t in leaves)]

    expected = run(lambda q, k, v, s: LocalContext().attention(q, k, v, dense, sinks=s), torch.float32)
    actual = run(lambda q, k, v, s: attention_with_sinks(q, k, v, s, form), torch.bfloat16)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), actual, expected):
        error = ((a - e).norm() / e.norm()).item()
        assert error < 2e-2, f"{name}: {error:.2e}"
