"""Mixture-of-experts decoders (Mixtral, DeepSeekMoE) as pure functions over a parameter tree.

The same layer sequence as `models.llama` (`embed, blocks.0 .. blocks.{L-1}, head`), with the same
embedding, attention and head; each block's feed-forward is `models.moe.moe_forward` (the first
`first_dense_layers` blocks keep a dense SwiGLU).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from models import llama, moe, spec
from models.config import MoEConfig, layer_kind
from models.context import ModelContext
from models.layers import attention_block, rms_norm, swiglu_block
from models.llama import RESIDUAL


@attrs.frozen
class MoEAux(llama.Aux):
    """`llama.Aux` plus what MoE blocks read: where to put router statistics, and the factor the
    caller multiplies the summed loss by before backward (the router losses are scaled with it)."""

    router_stats: moe.RouterStats | None = None
    loss_scale: float = 1.0


def make_aux(cfg: MoEConfig, positions: torch.Tensor, labels: torch.Tensor | None = None,
             router_stats: moe.RouterStats | None = None, loss_scale: float = 1.0) -> MoEAux:
    rope = llama.make_aux(cfg, positions).rope
    return MoEAux(rope=rope, labels=labels, router_stats=router_stats, loss_scale=loss_scale)


def block_forward(p: dict, x: torch.Tensor, aux: Any, ctx: ModelContext, *, cfg: MoEConfig,
                  index: int) -> torch.Tensor:
    h = ctx.constrain(rms_norm(x, p["attn_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    kind = layer_kind(cfg, index)
    attn = attention_block(p["attn"], h, aux.rope_of(kind), cfg.num_heads, cfg.num_kv_heads, ctx, aux.mask(kind),
                           norm_eps=cfg.norm_eps)
    x = x + ctx.constrain(attn, RESIDUAL, "residual")
    h = ctx.constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    return x + ctx.constrain(feed_forward(p, h, aux, ctx, cfg=cfg, index=index), RESIDUAL, "residual")


def feed_forward(p: dict, h: torch.Tensor, aux: Any, ctx: ModelContext, *, cfg: MoEConfig, index: int) -> torch.Tensor:
    """The block's MoE feed-forward (`p["moe"]`), or its dense SwiGLU (`p["mlp"]`)."""
    if "moe" in p:
        return ctx.per_token(functools.partial(moe.moe_forward, cfg=cfg, ctx=ctx, layer=index, aux=aux), p["moe"], h)
    return swiglu_block(p["mlp"], h, ctx)


def block_params(cfg: MoEConfig, index: int, attention: dict[str, Any], std: float, out_std: float) -> dict[str, Any]:
    """A block's specs around the given `attention` specs: norms, and the feed-forward of layer `index`."""
    params: dict[str, Any] = {
        "attn_norm": spec.ones((cfg.dim,), ("embed",)),
        "attn": attention,
        "mlp_norm": spec.ones((cfg.dim,), ("embed",)),
    }
    if cfg.is_moe_layer(index):
        params["moe"] = moe.moe_params(cfg, std, out_std)
    else:
        params["mlp"] = llama.swiglu_params(cfg.dense_ffn_dim, cfg.dim, std, out_std)
    return params


def layers(cfg: MoEConfig, block=block_forward) -> list[spec.Layer]:
    """The layer sequence, each block's forward `block(p, x, aux, ctx, cfg=, index=)`."""
    std, out_std = llama.init_stds(cfg)
    embed, head = llama.embed_and_head(cfg)
    blocks = [spec.Layer(f"blocks.{i}", block_params(cfg, i, llama.attention_params(cfg, std, out_std), std, out_std),
                         functools.partial(block, cfg=cfg, index=i))
              for i in range(cfg.num_layers)]
    return [embed, *blocks, head]


def forward(params: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor, cfg: MoEConfig,
            ctx: ModelContext, router_stats: moe.RouterStats | None = None) -> torch.Tensor:
    """The whole model on a parameter tree keyed like `layers(cfg)`: summed loss over the labels."""
    return run(layers(cfg), make_aux, params, tokens, labels, cfg, ctx, router_stats)


def run(model_layers: list[spec.Layer], aux_of, params: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor,
        cfg: MoEConfig, ctx: ModelContext, router_stats: moe.RouterStats | None = None) -> torch.Tensor:
    """`model_layers` on one process, with the aux `aux_of(cfg, positions, labels, router_stats)`
    and the masks of rows of one document each."""
    aux = aux_of(cfg, torch.arange(tokens.shape[1], device=tokens.device), labels, router_stats)
    aux = attrs.evolve(aux, masks=llama.one_document_masks(cfg, ctx, *tokens.shape))
    return llama.run_layers(model_layers, params, tokens, aux, ctx)


def is_expert_weight(param: spec.ParamSpec) -> bool:
    """A stacked weight (or bias) of all routed experts, of which a token uses only top_k slices."""
    return param.axes[0] == "expert"

