"""Which model family a config describes: its layer sequence and its per-micro-batch `Aux`."""

from __future__ import annotations

import torch

from models import llama, mixtral, moe, spec
from models.config import LlamaConfig, MoEConfig

ModelConfig = LlamaConfig | MoEConfig


def layers(cfg: ModelConfig) -> list[spec.Layer]:
    return mixtral.layers(cfg) if isinstance(cfg, MoEConfig) else llama.layers(cfg)


def make_aux(cfg: ModelConfig, positions: torch.Tensor, *, loss_scale: float = 1.0) -> llama.Aux:
    """RoPE tables for `positions`; for MoE models also a router-statistics sink and the loss
    scale the router losses follow."""
    if isinstance(cfg, MoEConfig):
        return mixtral.make_aux(cfg, positions, router_stats=moe.RouterStats(), loss_scale=loss_scale)
    return llama.make_aux(cfg, positions)
