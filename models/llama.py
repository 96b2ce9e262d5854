"""The Llama family as pure functions over a parameter tree.

The model is the layer sequence `embed, block.0 .. block.{L-1}, head`; `layers(cfg)` returns it
with each layer's parameter specs (shape, logical axes, init) and forward function.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import torch

from models import masking, spec
from models.config import LlamaConfig
from models.context import ModelContext
from models.masking import AttentionMask
from models.layers import (RESIDUAL, attention_block, rms_norm, rope_attention_factor, rope_frequencies, rope_table,
                           swiglu_block)


@attrs.frozen
class Aux:
    """What every layer of one micro-batch shares."""

    rope: tuple[torch.Tensor, torch.Tensor]
    labels: torch.Tensor | None = None
    # Attention within documents, windows, chunks: one mask per mask kind of the layers
    # (masking.layer_masks); a kind that is missing or None attends plain causal.
    masks: dict[str, AttentionMask | None] = attrs.field(factory=dict)

    def mask(self, layer_kind: str) -> AttentionMask | None:
        """The mask of layers of `layer_kind` (models.config.LAYER_KINDS)."""
        return self.masks.get(masking.mask_kind(layer_kind))

    def rope_of(self, layer_kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE tables of layers of `layer_kind`: none for NoPE layers."""
        return None if layer_kind == "nope" else self.rope


def make_aux(cfg: LlamaConfig, positions: torch.Tensor, labels: torch.Tensor | None = None) -> Aux:
    """`positions` is [seq], or [batch, seq] when positions restart at each document."""
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return Aux(rope=rope_table(positions, inv_freq, rope_attention_factor(cfg.rope_scaling)), labels=labels)


def embed_forward(p: dict, tokens: torch.Tensor, aux: Aux, ctx: ModelContext) -> torch.Tensor:
    tokens = ctx.constrain(tokens, ("batch", "seq"), "input")
    return ctx.constrain(ctx.embedding(tokens, p["weight"]), RESIDUAL, "residual")


def block_forward(p: dict, x: torch.Tensor, aux: Aux, ctx: ModelContext, *, cfg: LlamaConfig,
                  kind: str = "full") -> torch.Tensor:
    h = ctx.constrain(rms_norm(x, p["attn_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    attn = attention_block(p["attn"], h, aux.rope_of(kind), cfg.num_heads, cfg.num_kv_heads, ctx, aux.mask(kind),
                           norm_eps=cfg.norm_eps)
    x = x + ctx.constrain(attn, RESIDUAL, "residual")
    h = ctx.constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), RESIDUAL, "block_input")
    return x + ctx.constrain(swiglu_block(p["mlp"], h, ctx), RESIDUAL, "residual")


def head_forward(p: dict, x: torch.Tensor, aux: Aux, ctx: ModelContext, *, cfg: LlamaConfig) -> torch.Tensor:
    """Final norm, output projection and the summed cross-entropy against `aux.labels`."""
    h = ctx.constrain(rms_norm(x, p["norm"], cfg.norm_eps), RESIDUAL, "block_input")
    return ctx.output_cross_entropy_sum(h, p["output"], aux.labels)


def init_stds(cfg) -> tuple[float, float]:
    """The init std of weights, and of the projections into the residual stream, which are
    scaled down with depth (GPT-2 style) so the residual's variance does not grow with it."""
    return cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)


def attention_params(cfg, std: float, out_std: float) -> dict[str, spec.ParamSpec]:
    hd, d = cfg.head_dim, cfg.dim
    params = {
        "wq": spec.normal((cfg.num_heads * hd, d), ("heads", "embed"), std),
        "wk": spec.normal((cfg.num_kv_heads * hd, d), ("kv_heads", "embed"), std),
        "wv": spec.normal((cfg.num_kv_heads * hd, d), ("kv_heads", "embed"), std),
        "wo": spec.normal((d, cfg.num_heads * hd), ("embed", "heads"), out_std),
    }
    if cfg.qk_norm:
        params.update(q_norm=spec.ones((hd,), ("head_dim",)), k_norm=spec.ones((hd,), ("head_dim",)))
    if cfg.attention_bias:
        params.update(bq=spec.zeros((cfg.num_heads * hd,), ("heads",)), bk=spec.zeros((cfg.num_kv_heads * hd,), ("kv_heads",)),
                      bv=spec.zeros((cfg.num_kv_heads * hd,), ("kv_heads",)), bo=spec.zeros((d,), ("embed",)))
    if cfg.attention_sinks:
        # One logit per head, split with the heads under tensor parallelism; never decayed.
        params["sinks"] = spec.ParamSpec((cfg.num_heads,), ("heads",), "normal", std, weight_decay=False)
    return params


def swiglu_params(width: int, dim: int, std: float, out_std: float) -> dict[str, spec.ParamSpec]:
    return {
        "w_gate": spec.normal((width, dim), ("mlp", "embed"), std),
        "w_up": spec.normal((width, dim), ("mlp", "embed"), std),
        "w_down": spec.normal((dim, width), ("embed", "mlp"), out_std),
    }


def embed_and_head(cfg) -> tuple[spec.Layer, spec.Layer]:
    """The first and last layers, shared by every decoder family here."""
    d = cfg.dim
    embedding = spec.ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), "normal", cfg.init_std, weight_decay=False)
    head_params: dict[str, Any] = {"norm": spec.ones((d,), ("embed",))}
    tied = {}
    if cfg.tie_embeddings:
        tied = {"output": "embed.weight"}
    else:
        head_params["output"] = spec.normal((cfg.vocab_size, d), ("vocab", "embed"), d**-0.5)
    return (spec.Layer("embed", {"weight": embedding}, embed_forward),
            spec.Layer("head", head_params, functools.partial(head_forward, cfg=cfg), tied=tied))


def layers(cfg: LlamaConfig) -> list[spec.Layer]:
    std, out_std = init_stds(cfg)
    block_params = {
        "attn_norm": spec.ones((cfg.dim,), ("embed",)),
        "attn": attention_params(cfg, std, out_std),
        "mlp_norm": spec.ones((cfg.dim,), ("embed",)),
        "mlp": swiglu_params(cfg.ffn_dim, cfg.dim, std, out_std),
    }
    embed, head = embed_and_head(cfg)
    blocks = [spec.Layer(f"blocks.{i}", block_params, functools.partial(block_forward, cfg=cfg, kind=kind))
              for i, kind in enumerate(cfg.layer_kinds)]
    return [embed, *blocks, head]


def run_layers(model_layers: list[spec.Layer], params: dict[str, Any], tokens: torch.Tensor, aux: Aux,
               ctx: ModelContext) -> torch.Tensor:
    """Runs a layer sequence on a parameter tree keyed by layer names (single process)."""
    x = tokens
    for layer in model_layers:
        layer_params = dict(_lookup(params, layer.name))
        for path, source in layer.tied.items():
            layer_params[path] = _lookup(params, source)
        x = layer.forward(layer_params, x, aux, ctx)
    return x


def one_document_masks(cfg, ctx: ModelContext, batch: int, seq: int) -> dict[str, AttentionMask | None]:
    """The masks of the model's layer kinds (windows, chunks) over rows of one document."""
    return masking.layer_masks(cfg, ctx, torch.zeros(batch, seq, dtype=torch.int64))


def forward(params: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor, cfg: LlamaConfig,
            ctx: ModelContext) -> torch.Tensor:
    """The whole model on a parameter tree keyed like `layers(cfg)`: summed loss over the labels."""
    aux = make_aux(cfg, torch.arange(tokens.shape[1], device=tokens.device), labels)
    aux = attrs.evolve(aux, masks=one_document_masks(cfg, ctx, *tokens.shape))
    return run_layers(layers(cfg), params, tokens, aux, ctx)


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree[key]
    return tree
