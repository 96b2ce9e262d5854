"""Causal attention on one rank's whole sequence on the fused kernels, and the shape checks that
choose how its inputs reach them: grouped-query K/V with their own heads where cuDNN takes them so
(SDPA's enable_gqa), else expanded to the query heads; MLA's narrower values as they are where cuDNN
takes them, else padded. Each check is SDPA's own, asked once per shape and logged."""

from __future__ import annotations

import functools
import logging

import torch
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

from models.context import causal_attention

logger = logging.getLogger("dtrain")


def fused_causal_attention(q, k, v, mask=None, scale=None, *, pad_values: bool | None = None,
                           expand_kv: bool | None = None) -> torch.Tensor:
    """`causal_attention` (`mask` in its reference meaning) on cuDNN's fused kernel where it takes
    the shapes. Grouped-query K/V go in with their own heads (SDPA's enable_gqa) where cuDNN takes
    them so; where it takes only equal head counts (older torch), K/V are expanded to the query
    heads first, since SDPA would otherwise run flash, slower on Hopper. Where V's head dim is
    smaller than q/k's (MLA): flash wants equal head dims, and cuDNN takes DeepSeek's 192/128 only
    in some torch and cuDNN versions. Where cuDNN does not take them as they are, V is padded with
    zeros to q's head dim, which leaves the output's first dims (and all gradients) as they are,
    and the output is cut back. `pad_values` and `expand_kv` True or False force the choices
    (benchmarks, tests). On CPUs SDPA's own kernels run them as they are."""
    if q.device.type != "cuda":
        return causal_attention(q, k, v, mask, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads != heads:
        if expand_kv is None:
            expand_kv = _gqa_layout(q.device.index, q.dtype, heads, kv_heads, q.shape[-1], v.shape[-1],
                                    q.requires_grad) == "expanded"
        if expand_kv:
            k, v = (expand_heads(t, heads) for t in (k, v))
    value_dim = v.shape[-1]
    if value_dim >= q.shape[-1]:
        return causal_attention(q, k, v, mask, scale)
    if pad_values is None:
        pad_values = not _cudnn_takes_head_dims(q.device.index, q.dtype, q.shape[-1], value_dim, q.requires_grad)
    if not pad_values:
        return causal_attention(q, k, v.contiguous(), mask, scale)
    v = torch.nn.functional.pad(v, (0, q.shape[-1] - value_dim))
    return causal_attention(q, k, v, mask, scale)[..., :value_dim]


@torch.compiler.assume_constant_result
def _cudnn_takes_head_dims(device_index: int, dtype: torch.dtype, qk_dim: int, v_dim: int,
                           needs_grad: bool) -> bool:
    # A compiled block asks while it is traced and keeps the answer (the shapes do not change).
    return cudnn_takes_head_dims(device_index, dtype, qk_dim, v_dim, needs_grad)


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, seq, kv_heads, head_dim] -> [batch, seq, heads, head_dim]: each KV head repeated for
    its group of adjacent query heads, as SDPA's enable_gqa groups them."""
    batch, seq, kv_heads, head_dim = t.shape
    return t.unsqueeze(3).expand(batch, seq, kv_heads, heads // kv_heads, head_dim).reshape(batch, seq, heads, head_dim)


@torch.compiler.assume_constant_result
def _gqa_layout(device_index: int, dtype: torch.dtype, heads: int, kv_heads: int, qk_dim: int, v_dim: int,
                needs_grad: bool) -> str:
    # A compiled block asks while it is traced and keeps the answer (the shapes do not change).
    return gqa_layout(device_index, dtype, heads, kv_heads, qk_dim, v_dim, needs_grad)


@functools.cache
def gqa_layout(device_index: int, dtype: torch.dtype, heads: int, kv_heads: int, qk_dim: int, v_dim: int,
               needs_grad: bool) -> str:
    """How grouped-query K/V reach SDPA on this GPU: "as is" (enable_gqa) where cuDNN takes them
    so or takes neither layout, "expanded" where cuDNN takes only K/V with the queries' head count.
    SDPA's own checks on small tensors of these heads and head dims in the model's BSHD layout."""
    def tensor(num_heads, dim):
        t = torch.empty(1, 256, num_heads, dim, device=torch.device("cuda", device_index), dtype=dtype)
        return t.requires_grad_(needs_grad).transpose(1, 2)

    q = tensor(heads, qk_dim)
    grouped = [tensor(kv_heads, qk_dim), tensor(kv_heads, v_dim)]
    expanded = [tensor(heads, qk_dim), tensor(heads, v_dim)]
    takes_grouped = bool(can_use_cudnn_attention(SDPAParams(q, *grouped, None, 0.0, True, True)))
    takes_expanded = bool(can_use_cudnn_attention(SDPAParams(q, *expanded, None, 0.0, True, False)))
    layout = "expanded" if takes_expanded and not takes_grouped else "as is"
    logger.info("attention with %d query and %d KV heads: cuDNN %s", heads, kv_heads,
                "takes the KV heads as they are" if takes_grouped else
                "takes them expanded to the query heads, which they are" if takes_expanded else
                "takes neither; SDPA chooses among its other kernels")
    return layout


@functools.cache
def cudnn_takes_head_dims(device_index: int, dtype: torch.dtype, qk_dim: int, v_dim: int, needs_grad: bool) -> bool:
    """SDPA's own check, on small tensors of these head dims in the BSHD layout the model gives."""
    def tensor(dim):
        t = torch.empty(1, 256, 8, dim, device=torch.device("cuda", device_index), dtype=dtype)
        return t.requires_grad_(needs_grad).transpose(1, 2)

    q, v = tensor(qk_dim), tensor(v_dim)
    takes = bool(can_use_cudnn_attention(SDPAParams(q, q, v, None, 0.0, True, False)))
    logger.info("attention with head dims q/k %d, v %d: %s", qk_dim, v_dim,
                "cuDNN as they are" if takes else f"v padded to {qk_dim} (cuDNN does not take them here)")
    return takes
