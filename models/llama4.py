"""Llama 4 (text) as pure functions over a parameter tree: the MoE decoder of `models.mixtral`
whose layers differ by kind (`Llama4Config.layer_pattern`, models.config.LAYER_KINDS):

- RoPE layers ("chunk") attend within chunks of absolute positions, with an RMSNorm without
  weight of each query and key head after RoPE (`qk_l2_norm`);
- NoPE layers ("nope") attend to the whole causal context without RoPE, their queries scaled by
  the temperature of their absolute position (`attn_temperature_tuning`, `query_scale`);
- MoE blocks route each token to its top-1 expert by sigmoid score, which scales the expert's
  input (`scale_expert_inputs`), beside an always-on shared expert; dense blocks have a SwiGLU of
  dense_ffn_dim.

RoPE is rotate-half here; the checkpoints' interleaved pairs are reordered on import
(dtrain/interop/llama4.py). The layer sequence is Mixtral's: `embed, blocks.0 .. blocks.{L-1}, head`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from models import mixtral, moe, spec
from models.config import layer_kind
from models.context import ModelContext
from models.family_configs import Llama4Config
from models.layers import RESIDUAL, attention_block, rms_norm


@attrs.frozen
class Llama4Aux(mixtral.MoEAux):
    """`MoEAux` plus what NoPE layers multiply their queries by, per token of this rank ([seq];
    None without temperature tuning)."""

    query_scale: torch.Tensor | None = None


def temperature(cfg: Llama4Config, positions: torch.Tensor) -> torch.Tensor:
    """1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) of absolute positions p (fp32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0


def make_aux(cfg: Llama4Config, positions: torch.Tensor, labels: torch.Tensor | None = None,
             router_stats: moe.RouterStats | None = None, loss_scale: float = 1.0) -> Llama4Aux:
    """`positions` [seq] are this rank's absolute positions in the row: the temperature follows
    them, also where the RoPE tables are later made from positions that restart at each document."""
    base = mixtral.make_aux(cfg, positions, labels, router_stats, loss_scale)
    scale = temperature(cfg, positions) if cfg.attn_temperature_tuning and "nope" in cfg.layer_kinds else None
    return Llama4Aux(**attrs.asdict(base, recurse=False), query_scale=scale)


def block_forward(p: dict, x: torch.Tensor, aux: Any, ctx: ModelContext, *, cfg: Llama4Config,
                  index: int) -> torch.Tensor:
    kind = layer_kind(cfg, index)
    nope = kind == "nope"
    h = ctx.constrain(rms_norm(x, p["attn_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    attn = attention_block(p["attn"], h, aux.rope_of(kind), cfg.num_heads, cfg.num_kv_heads, ctx, aux.mask(kind),
                           qk_norm_eps=cfg.norm_eps if cfg.qk_l2_norm and not nope else None,
                           query_scale=aux.query_scale if nope else None)
    x = x + ctx.constrain(attn, RESIDUAL, "residual")
    h = ctx.constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    return x + ctx.constrain(mixtral.feed_forward(p, h, aux, ctx, cfg=cfg, index=index), RESIDUAL, "residual")


def layers(cfg: Llama4Config) -> list[spec.Layer]:
    return mixtral.layers(cfg, block_forward)


def forward(params: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor, cfg: Llama4Config,
            ctx: ModelContext, router_stats: moe.RouterStats | None = None) -> torch.Tensor:
    """The whole model on a parameter tree keyed like `layers(cfg)`: summed loss over the labels."""
    return mixtral.run(layers(cfg), make_aux, params, tokens, labels, cfg, ctx, router_stats)
