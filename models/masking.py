"""Attention masks beyond causality: packed documents, sliding windows and chunks, in one form.

The query at position p sees the keys at positions first_key[p] .. p of its row. Packed documents
(a new document starts wherever the document id changes along a row) give first_key[p] = the start
of p's document; a sliding window of w tokens gives p - w + 1; chunks of c tokens (of absolute
positions in the row) p - p mod c; together, the latest of them:

    first = first_keys(document_ids, window=4096)       # [batch, seq] int64
    allowed(first, q_positions, k_positions)            # [batch, q, k] bool, for any split of the row

Positions are global positions in the row, so a context-parallel rank asks for its own query
positions against whichever keys it holds. `AttentionMask` carries `first_key` with the kernel-ready
forms of each call site (a dense boolean mask here; block masks or sequence offsets on GPUs), built
once per micro-batch before the forward and shared by every layer of its kind (`layer_masks`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen(eq=False)
class AttentionMask:
    """One micro-batch's mask: `first_key` [batch, seq] (global positions, on the compute device),
    and by call site name the form its kernel reads (see parallel/masked_attention.py)."""

    first_key: torch.Tensor
    window: int | None = None
    forms: dict[str, Any] = attrs.field(factory=dict)


def first_keys(document_ids: torch.Tensor, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """The first key position each query sees, [batch, seq] int64, from document ids [batch, seq]
    (contiguous runs; all zeros for one document per row), an optional sliding window and optional
    chunks of absolute positions."""
    positions = torch.arange(document_ids.shape[1], dtype=torch.int64, device=document_ids.device).expand(document_ids.shape)
    first = torch.where(segment_starts(document_ids), positions, torch.zeros_like(positions)).cummax(dim=1).values
    if window is not None:
        first = torch.maximum(first, positions - (window - 1))
    if chunk is not None:
        first = torch.maximum(first, positions - positions % chunk)
    return first


def segment_starts(document_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """[batch, seq] bool: where a document starts (the id changes along the row, and at position 0)
    or, with `chunk`, a chunk: the runs between are what chunked attention within documents keeps
    whole (each one causal on its own)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if chunk is not None:
        starts |= (torch.arange(document_ids.shape[1], device=document_ids.device) % chunk == 0)
    return starts


def mask_extent(cfg, kind: str) -> dict[str, int | None]:
    """The window and chunk of a layer kind of `cfg` (models.config.LAYER_KINDS), as `first_keys`
    and `ModelContext.attention_mask` take them."""
    return {"window": cfg.sliding_window if kind == "window" else None,
            "chunk": cfg.attention_chunk if kind == "chunk" else None}


def mask_kind(layer_kind: str) -> str:
    """The mask a layer of this kind attends with: NoPE layers attend as full ones."""
    return "full" if layer_kind == "nope" else layer_kind


def layer_masks(cfg, ctx, document_ids: torch.Tensor) -> dict[str, AttentionMask | None]:
    """One micro-batch's masks, one for each mask kind of `cfg`'s layers (`mask_kind`), from
    `ctx.attention_mask`; None where attention of that kind is plain causal."""
    kinds = dict.fromkeys(mask_kind(kind) for kind in cfg.layer_kinds)
    return {kind: ctx.attention_mask(document_ids, **mask_extent(cfg, kind), sinks=cfg.attention_sinks)
            for kind in kinds}


def is_plain_causal(first_key: torch.Tensor) -> bool:
    """Whether the mask lets every query see all earlier keys (one document per row, no window
    shorter than the row): plain causal attention then applies, on its fastest kernel."""
    return not bool(first_key.any())


def allowed(first_key: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[batch, q, k] bool: whether each query (at global q_positions) may see each key."""
    first = first_key[:, q_positions.to(first_key.device)]
    q = q_positions.to(first_key.device)[None, :, None]
    k = k_positions.to(first_key.device)[None, None, :]
    return (k <= q) & (k >= first[:, :, None])


def attended_pairs(first_key: torch.Tensor) -> int:
    """Query-key pairs the mask keeps, summed over the batch: the attention work a kernel that
    skips masked keys needs (a causal row of n tokens keeps n (n + 1) / 2)."""
    positions = torch.arange(first_key.shape[1], dtype=torch.int64, device=first_key.device)
    return int((positions - first_key + 1).sum())
