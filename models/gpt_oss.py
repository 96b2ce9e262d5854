"""gpt-oss as pure functions over a parameter tree: the MoE decoder of `models.mixtral` with the
parts that `GptOssConfig` turns on, each shared with any family that sets it:

- attention (models/layers.py `attention_block`): q/k/v/o biases (`bq`, `bk`, `bv`, `bo`; the
  output bias added once, to the reduced output) and a sink logit per head (`sinks`, through
  `ModelContext.attention(..., sinks=)`); windowed and full layers alternating (`layer_pattern`,
  one mask per kind in the aux); YaRN with its attention factor on cos/sin (`rope_scaling`, not
  truncated);
- the feed-forward (models/moe.py): the router's logits biased (`router_logit_bias`), the top k
  by logit weighted by their softmax; the experts' gate, up and down biased (`b_gate`, `b_up`,
  `b_down`) around gpt-oss's clamped SwiGLU (`ClampedSwiGLU`), through `ModelContext.experts`.

The layer sequence and its names are Mixtral's: `embed, blocks.0 .. blocks.{L-1}, head`.
"""

from __future__ import annotations

from typing import Any

import torch

from models import mixtral, moe, spec
from models.context import ModelContext
from models.family_configs import GptOssConfig


def layers(cfg: GptOssConfig) -> list[spec.Layer]:
    return mixtral.layers(cfg)


def forward(params: dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor, cfg: GptOssConfig,
            ctx: ModelContext, router_stats: moe.RouterStats | None = None) -> torch.Tensor:
    """The whole model on a parameter tree keyed like `layers(cfg)`: summed loss over the labels."""
    return mixtral.forward(params, tokens, labels, cfg, ctx, router_stats)
