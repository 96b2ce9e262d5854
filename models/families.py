"""Which model family a config describes: its layer sequence and its per-micro-batch `Aux`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models import deepseek, gpt_oss, llama, llama4, mixtral, mla, moe, mtp, spec
from models.config import DeepSeekConfig, LlamaConfig, MoEConfig
from models.family_configs import GptOssConfig, Llama4Config

ModelConfig = LlamaConfig | MoEConfig | DeepSeekConfig | GptOssConfig | Llama4Config


def layers(cfg: ModelConfig) -> list[spec.Layer]:
    if isinstance(cfg, DeepSeekConfig):
        return deepseek.layers(cfg)
    if isinstance(cfg, GptOssConfig):
        return gpt_oss.layers(cfg)
    if isinstance(cfg, Llama4Config):
        return llama4.layers(cfg)
    return mixtral.layers(cfg) if isinstance(cfg, MoEConfig) else llama.layers(cfg)


def make_aux(cfg: ModelConfig, positions: torch.Tensor, *, loss_scale: float = 1.0) -> llama.Aux:
    """RoPE tables for `positions`; for MoE models also a router-statistics sink and the loss
    scale the router losses follow; with multi-token prediction a sink for its losses."""
    if isinstance(cfg, DeepSeekConfig):
        stats = mtp.MTPStats() if cfg.mtp_depth else None
        return deepseek.make_aux(cfg, positions, router_stats=moe.RouterStats(), loss_scale=loss_scale,
                                 mtp_stats=stats)
    if isinstance(cfg, Llama4Config):
        return llama4.make_aux(cfg, positions, router_stats=moe.RouterStats(), loss_scale=loss_scale)
    if isinstance(cfg, MoEConfig):
        return mixtral.make_aux(cfg, positions, router_stats=moe.RouterStats(), loss_scale=loss_scale)
    return llama.make_aux(cfg, positions)


def rope(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables of `positions` ([seq], or [batch, seq] restarting at each document)."""
    if isinstance(cfg, DeepSeekConfig):
        return mla.rope(cfg, positions)
    return llama.make_aux(cfg, positions).rope


def block_path(cfg: ModelConfig) -> Callable[[int], str]:
    """Layer index -> the path of its block in the parameter tree (for MoE layers' router bias)."""
    if isinstance(cfg, DeepSeekConfig):
        return lambda layer: deepseek.block_path(cfg, layer)
    return lambda layer: f"blocks.{layer}"
