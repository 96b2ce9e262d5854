"""Building blocks shared by the model families: RMSNorm, RoPE, attention and SwiGLU sub-blocks."""

from __future__ import annotations

import math

import torch

from models.config import RopeScaling, YarnScaling
from models.context import ModelContext
from models.masking import AttentionMask


RESIDUAL = ("batch", "seq", "embed")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the compute dtype: bf16 variance loses too many bits.
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3.1 or YaRN scaling of the long wavelengths."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if isinstance(scaling, YarnScaling):
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling).float()
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, blended)
    scaled = torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)
    return scaled.float()


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: YarnScaling) -> torch.Tensor:
    """Dims that turn fewer than beta_slow times over the original context are interpolated (divided by
    the factor), those that turn more than beta_fast times kept, with a linear ramp between."""
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] (or [batch, seq, head_dim] for per-sample positions, e.g.
    restarting at each document) for the given token positions (half-split layout), times
    `factor` (YaRN's attention factor)."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def rope_attention_factor(scaling: RopeScaling | YarnScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return scaling.attention_factor() if isinstance(scaling, YarnScaling) else 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates [batch, seq, heads, head_dim] by the position angles (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # [seq, dim] or [batch, seq, dim] -> broadcast over the heads dim of x.
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


def attention_block(p: dict, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                    num_heads: int, num_kv_heads: int, ctx: ModelContext,
                    mask: AttentionMask | None = None, *, norm_eps: float = 1e-6, qk_norm_eps: float | None = None,
                    query_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query self-attention: projections (plus `bq`, `bk`, `bv` where `p` has them),
    qk-norm where `p` has its weights (`q_norm`, `k_norm`: RMSNorm over head_dim with eps
    `norm_eps`, Qwen3's), RoPE (none where `rope` is None: NoPE layers), with `qk_norm_eps` an
    RMSNorm without weight of each query and key head after RoPE (Llama 4's), queries times
    `query_scale` [seq] (Llama 4's temperature), causal attention (limited to the keys `mask`
    keeps: within documents, a window, a chunk; with `p["sinks"]`, attention sinks), output
    projection (plus `bo`, added once to the reduced output: under tensor parallelism it is whole
    on every rank)."""
    batch, seq, _ = x.shape
    head_dim = p["wq"].shape[0] // num_heads
    q, k, v = ctx.linear_many(x, [p["wq"], p["wk"], p["wv"]])
    if "bq" in p:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = q.view(batch, seq, num_heads, head_dim)
    k = k.view(batch, seq, num_kv_heads, head_dim)
    v = v.view(batch, seq, num_kv_heads, head_dim)
    q = ctx.constrain(q, ("batch", "seq", "heads", "head_dim"), "attention")
    k = ctx.constrain(k, ("batch", "seq", "kv_heads", "head_dim"), "attention")
    v = ctx.constrain(v, ("batch", "seq", "kv_heads", "head_dim"), "attention")
    if "q_norm" in p:
        q, k = rms_norm(q, p["q_norm"], norm_eps), rms_norm(k, p["k_norm"], norm_eps)
    if rope is not None:
        cos, sin = (ctx.constrain(t, ("batch", "seq", "head_dim")[-t.ndim:], "attention") for t in rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if qk_norm_eps is not None:
        q, k = weightless_rms_norm(q, qk_norm_eps), weightless_rms_norm(k, qk_norm_eps)
    if query_scale is not None:
        q = q * ctx.constrain(query_scale.view(-1, 1, 1).to(q.dtype), ("seq", None, None), "attention")
    kwargs = {"sinks": p["sinks"]} if "sinks" in p else {}
    out = ctx.attention(q, k, v, **kwargs) if mask is None else ctx.attention(q, k, v, mask, **kwargs)
    out = ctx.linear(out.reshape(batch, seq, num_heads * head_dim), p["wo"])
    if "bo" in p:
        out = ctx.constrain(out, RESIDUAL, "residual") + p["bo"]
    return out


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim without a weight, statistics in fp32 (Llama 4's qk-norm)."""
    x_fp32 = x.float()
    return (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def swiglu_block(p: dict, x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    gate, up = ctx.linear_many(x, [p["w_gate"], p["w_up"]])
    return ctx.linear(torch.nn.functional.silu(gate) * up, p["w_down"])
