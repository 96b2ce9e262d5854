"""Grouped-query attention on the fused kernels: K/V with their own heads or expanded to the query
heads give the same attention and gradients (CPU: SDPA's math kernel, exactly; `gpu`: cuDNN and
the expansion the layout check asks for, against fp32 math)."""

from __future__ import annotations

import torch

from models.context import causal_attention
from parallel.fused_attention import expand_heads, fused_causal_attention


def _inputs(device, dtype, batch=2, seq=256, heads=8, kv_heads=2, head_dim=64):
    generator = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim)]
    return [torch.randn(shape, generator=generator).to(device, dtype).requires_grad_() for shape in shapes]


def _attention_and_grads(attend, q, k, v, grad):
    out = attend(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out, dq, dk, dv


def test_expanded_heads_repeat_each_kv_head_for_its_adjacent_query_heads():
    k = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 4)
    assert torch.equal(expand_heads(k, 6), k.repeat_interleave(3, dim=2))
    q, k, v = _inputs("cpu", torch.float32)
    grad = torch.randn_like(q)
    grouped = _attention_and_grads(causal_attention, q, k, v, grad)
    expanded = _attention_and_grads(lambda q, k, v: causal_attention(q, expand_heads(k, 8), expand_heads(v, 8)),
                                    q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), grouped, expanded):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    # On the CPU the fused entry point is the reference itself.
    assert torch.equal(fused_causal_attention(q, k, v), grouped[0])
