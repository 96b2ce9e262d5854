"""Model FLOPs per token, by the convention of BENCHMARKS.md (the MFU numerator)."""

from __future__ import annotations

import math

from models import llama, spec
from models.config import LlamaConfig


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that take part in a matmul per token: every 2-D weight except the input
    embedding; the output head counts, also when it is tied to the embedding."""
    layers = llama.layers(cfg)
    total = 0
    for layer in layers:
        if layer.name == "embed":
            continue
        total += sum(math.prod(s.shape) for _, s in spec.flatten(layer.params) if len(s.shape) >= 2)
        total += len(layer.tied) * cfg.vocab_size * cfg.dim
    return total


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """6 N (forward + backward matmuls) + 12 L d S (attention scores and values, causal or not)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.num_layers * cfg.dim * seq_len
