"""Grouped-query attention on the fused kernels: K/V with their own heads or expanded to the query
heads give the same attention and gradients (CPU: SDPA's math kernel, exactly; `gpu`: cuDNN and
the expansion the layout check asks for, against fp32 math)."""

from __future__ import annotations

import pytest
import torch

from models.context import causal_attention
from parallel.fused_attention import fused_causal_attention, gqa_layout
from tests.unit.test_gqa_attention import _inputs, _attention_and_grads


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_grouped_and_expanded_kv_match_fp32_math(head_dim):
    q, k, v = _inputs("cuda", torch.bfloat16, head_dim=head_dim)
    grad = torch.randn_like(q)
    reference = _attention_and_grads(causal_attention, *(t.detach().double().requires_grad_() for t in (q, k, v)),
                                     grad.double())
    layout = gqa_layout(torch.cuda.current_device(), torch.bfloat16, 8, 2, head_dim, head_dim, True)
    assert layout in ("as is", "expanded")
    for expand in (None, False, True):
        ours = _attention_and_grads(lambda q, k, v: fused_causal_attention(q, k, v, expand_kv=expand), q, k, v, grad)
        for name, a, b in zip(("out", "dq", "dk", "dv"), ours, reference):
            error = ((a.double() - b).abs().max() / b.abs().max()).item()
            assert error < 2e-2, (expand, name, error)
