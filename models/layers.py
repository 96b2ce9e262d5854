"""Building blocks shared by the model families: RMSNorm, RoPE, attention and SwiGLU sub-blocks."""

from __future__ import annotations

import math

import torch

from models.config import RopeScaling, YarnScaling
from models.context import ModelContext
from models.masking import AttentionMask


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

    low = max(math.floor(dim_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_of(scaling.beta_slow)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] (or [batch, seq, head_dim] for per-sample positions, e.g.
    restarting at each document) for the given token positions (half-split layout)."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


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
                    mask: AttentionMask | None = None, *, norm_eps: float = 1e-6) -> torch.Tensor:
    """Grouped-query self-attention: projections, qk-norm where `p` has its weights (`q_norm`,
    `k_norm`: RMSNorm over head_dim with eps `norm_eps`), RoPE (none where `rope` is None: NoPE
    layers), causal attention (limited to the keys `mask` keeps: within documents, a window, a
    chunk), output projection."""
    batch, seq, _ = x.shape
    head_dim = p["wq"].shape[0] // num_heads
    q, k, v = ctx.linear_many(x, [p["wq"], p["wk"], p["wv"]])
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
    out = ctx.attention(q, k, v) if mask is None else ctx.attention(q, k, v, mask)
    return ctx.linear(out.reshape(batch, seq, num_heads * head_dim), p["wo"])


def swiglu_block(p: dict, x: torch.Tensor, ctx: ModelContext) -> torch.Tensor:
    gate, up = ctx.linear_many(x, [p["w_gate"], p["w_up"]])
    return ctx.linear(torch.nn.functional.silu(gate) * up, p["w_down"])
