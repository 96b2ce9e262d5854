"""Multi-head Latent Attention (DeepSeek-V2/V3) as pure functions over a parameter tree.

    q                = x W_q              or  RMSNorm(x W_qa) W_qb         (q_lora_rank > 0)
    [c, k_rope]      = x W_kva            c: the kv latent, k_rope: one RoPE key per token
    [k_nope, v]      = RMSNorm(c) W_kvb   per head
    q = [q_nope, RoPE(q_rope)],  k = [k_nope, RoPE(k_rope)] (the same k_rope for every head)
    out              = softmax(q k^T * scale) v W_o

Keys and queries have qk_nope_head_dim + qk_rope_head_dim dims, values v_head_dim: the context's
attention takes a value head dim of its own. This is the training form (keys and values expanded
per head), as DeepSeek trains; the absorbed form that attends in the latent space is for decoding.
Under tensor parallelism the heads split (W_qb, W_kvb rows, W_o columns) and the latent projections
stay whole on every rank, as in Megatron.
"""

from __future__ import annotations

import torch

from models import spec
from models.config import DeepSeekConfig, YarnScaling, yarn_mscale
from models.context import ModelContext
from models.layers import apply_rope, rms_norm, rope_attention_factor, rope_frequencies, rope_table
from models.masking import AttentionMask

# The latent norms of DeepSeek's checkpoints use this epsilon whatever rms_norm_eps says (their
# reference code and transformers' fix it).
LATENT_NORM_EPS = 1e-6


def attention_params(cfg: DeepSeekConfig, std: float, out_std: float) -> dict[str, spec.ParamSpec]:
    heads, d = cfg.num_heads, cfg.dim
    params: dict[str, spec.ParamSpec] = {}
    if cfg.q_lora_rank:
        params["wq_a"] = spec.normal((cfg.q_lora_rank, d), ("latent", "embed"), std)
        params["q_norm"] = spec.ones((cfg.q_lora_rank,), ("latent",))
        params["wq_b"] = spec.normal((heads * cfg.qk_head_dim, cfg.q_lora_rank), ("heads", "latent"), std)
    else:
        params["wq"] = spec.normal((heads * cfg.qk_head_dim, d), ("heads", "embed"), std)
    params["wkv_a"] = spec.normal((cfg.kv_lora_rank + cfg.qk_rope_head_dim, d), ("latent", "embed"), std)
    params["kv_norm"] = spec.ones((cfg.kv_lora_rank,), ("latent",))
    params["wkv_b"] = spec.normal((heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                                  ("heads", "latent"), std)
    params["wo"] = spec.normal((d, heads * cfg.v_head_dim), ("embed", "heads"), out_std)
    return params


def softmax_scale(cfg: DeepSeekConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 where YaRN sets it."""
    scale = cfg.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling
    if isinstance(scaling, YarnScaling) and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def rope(cfg: DeepSeekConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the qk_rope_head_dim rotary part, with YaRN's attention factor applied."""
    inv_freq = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    return rope_table(positions, inv_freq, rope_attention_factor(cfg.rope_scaling))


def attention(p: dict, x: torch.Tensor, rope_cos_sin: tuple[torch.Tensor, torch.Tensor], cfg: DeepSeekConfig,
              ctx: ModelContext, mask: AttentionMask | None = None) -> torch.Tensor:
    """MLA on [batch, seq, embed] (normed block input), same shape out; `mask` (documents, a sliding
    window) as `ModelContext.attention` takes it."""
    batch, seq, _ = x.shape
    heads, nope, rotary, v_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    # The two projections of x: one matmul where the context fuses them (DeepSeek's fused q/kv down-projection).
    q, kv_a = ctx.linear_many(x, [p["wq"] if "wq" in p else p["wq_a"], p["wkv_a"]])
    if "wq_b" in p:
        q = ctx.linear(rms_norm(q, p["q_norm"], LATENT_NORM_EPS), p["wq_b"])
    latent, k_rope = kv_a.split([cfg.kv_lora_rank, rotary], dim=-1)
    kv = ctx.linear(rms_norm(latent, p["kv_norm"], LATENT_NORM_EPS), p["wkv_b"])
    by_head = ("batch", "seq", "heads", "head_dim")
    q = ctx.constrain(q.view(batch, seq, heads, nope + rotary), by_head, "attention")
    kv = ctx.constrain(kv.view(batch, seq, heads, nope + v_dim), by_head, "attention")
    cos, sin = (ctx.constrain(t, ("batch", "seq", "head_dim")[-t.ndim:], "attention") for t in rope_cos_sin)
    q_nope, q_rope = q.split([nope, rotary], dim=-1)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
    # One rotary key per token, shared by all heads. Expanded here, so that under tensor
    # parallelism each rank takes its own heads' share and the key's gradient sums over them.
    k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)
    k = torch.cat([k_nope, k_rope.expand(batch, seq, heads, rotary)], dim=-1)
    out = ctx.attention(q, k, v, mask, scale=softmax_scale(cfg))
    return ctx.linear(out.reshape(batch, seq, heads * v_dim), p["wo"])
