"""The DeepSeek-V2/V3 family as pure functions over a parameter tree.

The layer sequence `embed, blocks.0 .. blocks.{L-1}, [mtp,] head`: Llama's embedding and head;
blocks of Multi-head Latent Attention (`models.mla`) and the MoE feed-forward of `models.mixtral`
(the first `first_dense_layers` dense), with group-limited routing where configured
(`models.moe`); and, with mtp_depth > 0, the multi-token prediction layer (`models.mtp`), which
shares the embedding, the final norm and the output projection. The MTP layer and the head both
read the last block's output; the MTP layer gives a term that the head's loss is added to.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from models import llama, mixtral, mla, moe, mtp, spec
from models.config import DeepSeekConfig, layer_kind
from models.context import ModelContext
from models.layers import rms_norm
from models.llama import RESIDUAL


@attrs.frozen
class DeepSeekAux(mixtral.MoEAux):
    """`MoEAux` plus what the MTP layer reads: the tokens ahead and their labels
    (`mtp.future_targets`, [batch, seq, depth, 2]) and where to put its losses."""

    mtp_targets: torch.Tensor | None = None
    mtp_stats: mtp.MTPStats | None = None


def make_aux(cfg: DeepSeekConfig, positions: torch.Tensor, labels: torch.Tensor | None = None,
             router_stats: moe.RouterStats | None = None, loss_scale: float = 1.0,
             mtp_stats: mtp.MTPStats | None = None) -> DeepSeekAux:
    return DeepSeekAux(rope=mla.rope(cfg, positions), labels=labels, router_stats=router_stats,
                       loss_scale=loss_scale, mtp_stats=mtp_stats)


def block_forward(p: dict, x: torch.Tensor, aux: Any, ctx: ModelContext, *, cfg: DeepSeekConfig,
                  index: int) -> torch.Tensor:
    h = ctx.constrain(rms_norm(x, p["attn_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    attn = mla.attention(p["attn"], h, aux.rope, cfg, ctx, aux.mask(layer_kind(cfg, index)))
    x = x + ctx.constrain(attn, RESIDUAL, "residual")
    h = ctx.constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    return x + ctx.constrain(mixtral.feed_forward(p, h, aux, ctx, cfg=cfg, index=index), RESIDUAL, "residual")


def layers(cfg: DeepSeekConfig) -> list[spec.Layer]:
    std, out_std = llama.init_stds(cfg)

    def block_params(index: int) -> dict[str, Any]:
        return mixtral.block_params(cfg, index, mla.attention_params(cfg, std, out_std), std, out_std)

    embed, head = llama.embed_and_head(cfg)
    blocks = [spec.Layer(f"blocks.{i}", block_params(i), functools.partial(block_forward, cfg=cfg, index=i))
              for i in range(cfg.num_layers)]
    tail = []
    if cfg.mtp_depth:
        forward = functools.partial(mtp.mtp_forward, cfg=cfg, block_forward=functools.partial(block_forward, cfg=cfg))
        tail.append(spec.Layer("mtp", mtp.mtp_params(cfg, block_params), forward, tied=mtp.tied_sources(cfg)))
    return [embed, *blocks, *tail, head]


def block_path(cfg: DeepSeekConfig, layer: int) -> str:
    """Where the block of layer `layer` lives in the parameter tree (MTP blocks number on from L)."""
    if layer < cfg.num_layers:
        return f"blocks.{layer}"
    return f"mtp.{layer - cfg.num_layers}.block"


def forward(params: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor, cfg: DeepSeekConfig,
            ctx: ModelContext, router_stats: moe.RouterStats | None = None,
            mtp_stats: mtp.MTPStats | None = None) -> torch.Tensor:
    """The whole model on a parameter tree keyed like `layers(cfg)`: the summed next-token loss over
    the labels (plus the MTP term, zero in value: the MTP losses reach the gradient, and
    `mtp_stats`)."""
    aux = make_aux(cfg, torch.arange(tokens.shape[1], device=tokens.device), labels, router_stats,
                   mtp_stats=mtp_stats)
    aux = attrs.evolve(aux, masks=llama.one_document_masks(cfg, ctx, *tokens.shape))
    by_name = {layer.name: layer for layer in layers(cfg)}
    mtp_layer, head = by_name.pop("mtp", None), by_name.pop("head")
    x = llama.run_layers(list(by_name.values()), params, tokens, aux, ctx)
    loss = llama.run_layers([head], params, x, aux, ctx)
    if mtp_layer is None:
        return loss
    aux = attrs.evolve(aux, mtp_targets=mtp.future_targets(labels, cfg.mtp_depth))
    return loss + llama.run_layers([mtp_layer], params, x, aux, ctx)
