"""Model FLOPs per token, by the convention of BENCHMARKS.md (the MFU numerator)."""

from __future__ import annotations

import math

from models import families, mixtral, spec
from models.config import LlamaConfig, MoEConfig


def _active_size(param: spec.ParamSpec, cfg: LlamaConfig | MoEConfig) -> int:
    """Elements of `param` one token uses: for stacked expert weights, its top_k experts' slices."""
    size = math.prod(param.shape)
    if isinstance(cfg, MoEConfig) and mixtral.is_expert_weight(param):
        return size // cfg.num_experts * cfg.top_k
    return size


def active_params(cfg: LlamaConfig | MoEConfig) -> int:
    """Parameters one token uses, embeddings included (the "active" count MoE papers publish)."""
    return sum(_active_size(p, cfg) for layer in families.layers(cfg) for _, p in spec.flatten(layer.params))


def matmul_params(cfg: LlamaConfig | MoEConfig) -> int:
    """Parameters that take part in a matmul per token: every 2-D weight except the input
    embedding; the output head counts, also when it is tied to the embedding. For MoE only the
    active experts count; the router (a matmul over all experts) counts whole."""
    total = 0
    for layer in families.layers(cfg):
        if layer.name == "embed":
            continue
        total += sum(_active_size(s, cfg) for _, s in spec.flatten(layer.params) if len(s.shape) >= 2)
        total += len(layer.tied) * cfg.vocab_size * cfg.dim
    return total


def flops_per_token(cfg: LlamaConfig | MoEConfig, seq_len: int, attended_keys: float | None = None) -> float:
    """6 N (forward + backward matmuls) + 12 L d S (attention scores and values, causal or not: the
    convention of BENCHMARKS.md). With `attended_keys`, the mean number of keys a query attends to,
    the attention term counts those keys instead of S: the work actually needed, which for packed
    documents is the sum of their causal attention ((S + 1) / 2 keys for one causal document)."""
    keys = seq_len if attended_keys is None else attended_keys
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.num_layers * cfg.dim * keys
