"""The one door between the functional core and the parallel backend.

Forward functions call only these methods for anything that depends on how the model is laid
out on devices. `LocalContext` is the single-device meaning of each; the parallel backend
(`parallel.context.ParallelContext`) gives the same methods their sharded meaning.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class ModelContext(Protocol):
    def constrain(self, x: torch.Tensor, axes: tuple[str | None, ...], region: str) -> torch.Tensor:
        """Lays out activation `x` (one logical axis per dim) as the plan wants it in `region`."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T with the configured precision backend (weight is [out, in])."""

    def embedding(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of `weight` [vocab, embed] for each token id."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over [batch, seq, heads, head_dim] tensors; k/v may have fewer heads (GQA)."""

    def cross_entropy_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy in fp32; labels of -100 are ignored."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on [batch, seq, heads, head_dim] inputs, GQA by head groups."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(1, 2)


class LocalContext:
    """Everything on one device: no constraints, plain matmuls, SDPA with its default kernel choice."""

    def constrain(self, x, axes, region):
        return x

    def linear(self, x, weight):
        return F.linear(x, weight)

    def embedding(self, tokens, weight):
        return F.embedding(tokens, weight)

    def attention(self, q, k, v):
        return causal_attention(q, k, v)

    def cross_entropy_sum(self, logits, labels):
        return F.cross_entropy(
            logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=-100
        )
