"""Attention within documents and sliding windows (models/masking.py) on fused kernels.

A mask is built once per micro-batch, for each call site of the attention (a site is which query
positions meet which key positions: the whole row on one device, a context-parallel rank's chunks
against the gathered keys, one block of the ring), in the form its kernel reads (`MaskForm`). The
kernel of a site, `choose_kernel`:

- no mask, or a mask that is plain causal (one document per row, no window shorter than it):
  cuDNN SDPA, as before (parallel/context.py);
- CPU: SDPA with a dense boolean mask, the reference meaning that the CPU tests check;
- CUDA, a site over the whole row in order (one GPU, tensor parallel, a2a context parallel), bf16 or
  fp16: variable-length flash attention with one sequence per document (cu_seqlens; the window as
  flash's left window; chunks as sequences of their own): flash-attn's `flash_attn_varlen_func`
  where that package is installed, else torch's `varlen_attn`. Tiles outside the documents are
  never launched;
- CUDA otherwise (all-gather and ring context parallelism, fp32): compiled FlexAttention with a
  block mask. Its block lists come from bounds per 128-token block (a block of keys is skipped,
  taken whole, or masked element-wise), so no [seq, seq] tensor is ever built.

`--attention-kernel flex|varlen|dense` overrides the choice (varlen only where it applies).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from models import masking
from models.errors import UserError
from parallel.attention_blocks import to_kernel_layout

ATTENTION_KERNELS = ("auto", "flex", "varlen", "dense")
FLEX_BLOCK = 128


@attrs.frozen(eq=False)
class MaskForm:
    """One call site's mask, ready for its kernel. `empty`: no query sees any of the site's keys."""

    kernel: str
    empty: bool
    dense: torch.Tensor | None = None  # [batch, 1, queries, keys] bool
    block_mask: Any = None             # FlexAttention's BlockMask
    cu_seqlens: torch.Tensor | None = None  # int32 [documents + 1] over the flattened batch
    max_seqlen: int = 0
    window: int | None = None


@functools.cache
def flash_attn_varlen():
    """flash-attn's variable-length function where the package (the `flash` extra) is installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    """torch's varlen_attn and the keywords its version takes (2.11 and 2.12 differ)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(windowed: bool) -> bool:
    if flash_attn_varlen() is not None:
        return True
    function, params = _torch_varlen()
    return function is not None and (not windowed or "window_size" in params)


def kernels(requested: str, device_type: str, dtype: torch.dtype) -> dict[tuple[bool, bool, bool], str]:
    """The kernel of every kind of site, by (whole row, windowed, with log-sum-exp)."""
    flags = (False, True)
    return {(whole_row, windowed, with_lse): choose_kernel(requested, device_type, dtype, whole_row, windowed, with_lse)
            for whole_row in flags for windowed in flags for with_lse in flags}


def choose_kernel(requested: str, device_type: str, dtype: torch.dtype, whole_row: bool,
                  windowed: bool, with_lse: bool = False) -> str:
    """The kernel of one kind of site (the module docstring gives the rule): `whole_row`, the site
    is the whole row in order; `windowed`, its layer has a sliding window or chunks; `with_lse`, the
    attention needs the log-sum-exp too (attention sinks), which the variable-length kernel does not
    give."""
    if requested not in ATTENTION_KERNELS:
        raise UserError(f"unknown --attention-kernel {requested!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    if device_type != "cuda" or requested == "dense":
        return "dense"
    varlen_fits = (whole_row and dtype in (torch.bfloat16, torch.float16) and varlen_available(windowed)
                   and not with_lse)
    if requested in ("auto", "varlen") and varlen_fits:
        return "varlen"
    return "flex"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned and asynchronous: a pageable copy would wait for the kernels already queued.
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_mask(document_ids: torch.Tensor, window: int | None, sites: dict, kernel_of, device: torch.device,
               chunk: int | None = None) -> masking.AttentionMask | None:
    """A micro-batch's mask (None where it is plain causal) with a form for each of `sites`
    (name -> (query positions, key positions), global, on the host); `kernel_of(whole_row)` names
    each site's kernel, whole_row saying whether the site is the whole row in order."""
    first = masking.first_keys(document_ids, window, chunk)
    if masking.is_plain_causal(first):
        return None
    first_on_device = to_device(first, device)
    forms = {}
    for name, (q_positions, k_positions) in sites.items():
        whole_row = len(q_positions) == len(k_positions) == first.shape[1]
        forms[name] = build_form(kernel_of(whole_row), document_ids, first, q_positions, k_positions, window,
                                 device, first_on_device, chunk=chunk)
    return masking.AttentionMask(first_on_device, window, forms)


def build_form(kernel: str, document_ids: torch.Tensor, first_key: torch.Tensor, q_positions: torch.Tensor,
               k_positions: torch.Tensor, window: int | None, device: torch.device,
               first_key_on_device: torch.Tensor | None = None, chunk: int | None = None) -> MaskForm:
    """The form of one site, from host tensors: queries at global `q_positions` against keys at
    `k_positions` of rows whose mask is `first_key` [batch, seq] (masking.first_keys)."""
    some, full = _block_classes(first_key, q_positions, k_positions, FLEX_BLOCK)
    empty = not bool(some.any())
    if kernel == "dense":
        dense = masking.allowed(first_key, q_positions, k_positions).unsqueeze(1)
        return MaskForm(kernel, empty, dense=to_device(dense, device))
    if kernel == "varlen":
        cu_seqlens, max_seqlen = _segment_offsets(masking.segment_starts(document_ids, chunk))
        return MaskForm(kernel, empty, cu_seqlens=to_device(cu_seqlens, device), max_seqlen=max_seqlen,
                        window=window)
    if first_key_on_device is None:
        first_key_on_device = to_device(first_key, device)
    block_mask = _flex_block_mask(some, full, first_key_on_device, to_device(q_positions, device),
                                  to_device(k_positions, device), (len(q_positions), len(k_positions)), device)
    return MaskForm(kernel, empty, block_mask=block_mask)


def _segment_offsets(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Start offsets of every segment (document, or chunk of one: `masking.segment_starts`) of the
    flattened batch, and the longest segment."""
    batch, seq = starts.shape
    offsets = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([batch * seq])])
    return offsets.to(torch.int32), int(offsets.diff().max())


def _block_bounds(positions: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Least and greatest of each run of `block` entries along the last dim (the last run may be short)."""
    pad = -positions.shape[-1] % block
    if pad:
        positions = torch.cat([positions, positions[..., -1:].expand(*positions.shape[:-1], pad)], dim=-1)
    blocks = positions.unflatten(-1, (-1, block))
    return blocks.amin(-1), blocks.amax(-1)


def _block_classes(first_key, q_positions, k_positions, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, query blocks, key blocks] bools: blocks some query may see a key of, and blocks every
    query sees every key of. A query at p sees [first[p], p]; over a block of queries these ranges
    join into [least first, greatest p], so `some` is exact for runs of consecutive positions
    (conservative otherwise: the kernel's element-wise mask then decides)."""
    q_low, q_high = _block_bounds(q_positions, block)
    k_low, k_high = _block_bounds(k_positions, block)
    first_low, first_high = _block_bounds(first_key[:, q_positions], block)
    k_low, k_high = k_low[None, None, :], k_high[None, None, :]
    some = (k_low <= q_high[None, :, None]) & (k_high >= first_low[:, :, None])
    full = (k_high <= q_low[None, :, None]) & (k_low >= first_high[:, :, None])
    return some, full


def _flex_block_mask(some, full, first_key, q_positions, k_positions, seq_lengths, device):
    from torch.nn.attention.flex_attention import BlockMask

    def lists(blocks):  # counts [batch, 1, q blocks] and indices [batch, 1, q blocks, k blocks], int32
        counts = blocks.sum(-1, dtype=torch.int32)
        indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return to_device(counts[:, None], device), to_device(indices[:, None], device)

    def mask_mod(b, h, q_index, k_index):
        q, k = q_positions[q_index], k_positions[k_index]
        return (k <= q) & (k >= first_key[b, q])

    partial_counts, partial_indices = lists(some & ~full)
    full_counts, full_indices = lists(full)
    return BlockMask.from_kv_blocks(partial_counts, partial_indices, full_counts, full_indices,
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=seq_lengths)


# ---------------------------------------------------------------------------------------------
# Attention of one site.


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: MaskForm,
           scale: float | None = None) -> torch.Tensor:
    """Masked causal attention of [batch, seq, heads, head_dim] inputs (k/v may have fewer heads);
    `scale` multiplies the scores (None: head_dim ** -0.5)."""
    if form.kernel == "varlen":
        return _varlen(q, k, v, form, scale)
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    if form.kernel == "flex":
        return _flex(q_, k_, v_, form.block_mask, scale=scale).transpose(1, 2)
    gqa = k.shape[2] != q.shape[2]
    return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=form.dense, enable_gqa=gqa, scale=scale).transpose(1, 2)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, block_mask, with_lse: bool = False, scale: float | None = None):
    """FlexAttention on [batch, heads, seq, head_dim]; compiled on GPUs (eager flex materialises the
    scores), eager on the CPU (forward only there)."""
    from torch.nn.attention import flex_attention as flex

    function = _compiled_flex() if q.is_cuda else flex.flex_attention
    kwargs = dict(block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1], scale=scale)
    if not with_lse:
        return function(q, k, v, **kwargs)
    if hasattr(flex, "AuxRequest"):
        out, aux = function(q, k, v, return_aux=flex.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return function(q, k, v, return_lse=True, **kwargs)


@torch.compiler.disable
def _varlen(q, k, v, form: MaskForm, scale: float | None = None) -> torch.Tensor:
    """Outside compiled graphs: the longest document is a host integer that changes every micro-batch,
    and a graph would be specialised (and recompiled) on it."""
    batch, seq = q.shape[:2]
    value_dim = v.shape[-1]
    if value_dim < q.shape[-1]:  # MLA: flash's kernels want one head dim; zero values leave the output's first dims
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    q_, k_, v_ = (t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v))
    left = form.window - 1 if form.window is not None else -1
    cu, longest = form.cu_seqlens, form.max_seqlen
    flash = flash_attn_varlen()
    if flash is not None:
        out = flash(q_, k_, v_, cu, cu, longest, longest, causal=True, window_size=(left, 0), softmax_scale=scale)
    else:
        function, params = _torch_varlen()
        kwargs = {}
        if scale is not None and "scale" in params:
            kwargs["scale"] = scale
        elif scale is not None:  # a version without the keyword: the same scores from scaled queries
            q_ = q_ * (scale * q.shape[-1] ** 0.5)
        if "window_size" in params:
            kwargs["window_size"] = (left, 0)
        else:
            kwargs["is_causal"] = True
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = k.shape[2] != q.shape[2]
        out = function(q_, k_, v_, cu, cu, longest, longest, **kwargs)
    return out.view(batch, seq, *out.shape[1:])[..., :value_dim]


# ---------------------------------------------------------------------------------------------
# Blocks of the ring: out and log-sum-exp forward; backward from the merged out and log-sum-exp
# (parallel/attention_blocks.py has the same contract for the unmasked kernels).


def block_forward(q, k, v, form: MaskForm, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [batch, seq_q, heads, head_dim] in q's dtype and lse [batch, heads, seq_q] (fp32; -inf for
    a query that sees no key of the block, whose out is then 0)."""
    if form.kernel == "flex":
        out, lse = _flex(*(t.transpose(1, 2) for t in (q, k, v)), form.block_mask, with_lse=True, scale=scale)
        return out.transpose(1, 2), lse.float()
    scores = _masked_scores(q, k, form.dense, scale)
    lse = scores.logsumexp(dim=-1)
    probs = (scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).exp()
    out = probs @ to_kernel_layout(v, q.shape[2]).to(probs.dtype)
    return out.to(q.dtype).transpose(1, 2), lse


def block_backward(grad_out, q, k, v, out, lse, form: MaskForm, scale: float | None = None):
    """dq [batch, seq_q, heads, head_dim], dk and dv [batch, seq_k, kv_heads, head_dim] of one block,
    given the final out and lse of the whole attention (fp32 for dk/dv under GQA)."""
    if form.kernel == "flex":
        return _flex_block_backward(grad_out, q, k, v, out, lse, form.block_mask, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    probs = (_masked_scores(q, k, form.dense, scale) - lse.unsqueeze(-1)).exp()
    grad_out_, out_, v_ = (to_kernel_layout(t, heads).to(probs.dtype) for t in (grad_out, out, v))
    delta = (grad_out_ * out_).sum(-1, keepdim=True)
    grad_scores = probs * (grad_out_ @ v_.transpose(-1, -2) - delta) * scale
    grad_q = (grad_scores @ to_kernel_layout(k, heads).to(probs.dtype)).transpose(1, 2)
    grad_k = (grad_scores.transpose(-1, -2) @ to_kernel_layout(q, heads).to(probs.dtype)).transpose(1, 2)
    grad_v = (probs.transpose(-1, -2) @ grad_out_).transpose(1, 2)
    if kv_heads != heads:
        grad_k, grad_v = (g.unflatten(2, (kv_heads, heads // kv_heads)).sum(3) for g in (grad_k, grad_v))
    return grad_q.to(q.dtype), grad_k, grad_v


def _masked_scores(q, k, dense: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """[batch, heads, seq_q, seq_k] scaled scores in fp32 (or better), -inf where the mask hides a key."""
    heads = q.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = to_kernel_layout(q, heads).to(compute) @ to_kernel_layout(k, heads).to(compute).transpose(-1, -2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (scores * scale).masked_fill(~dense, float("-inf"))


def _flex_block_backward(grad_out, q, k, v, out, lse, block_mask, scale=None):
    """Recomputes the block with autograd and pulls back the merge: out = sum_b w_b out_b with
    w_b = exp(lse_b - lse) gives d out_b = w_b d out and d lse_b = w_b <d out, out_b - out>."""
    q_, k_, v_ = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        block_out, block_lse = _flex(q_, k_, v_, block_mask, with_lse=True, scale=scale)
        weight = (block_lse.float() - lse).exp()
        grad = grad_out.transpose(1, 2).float()
        grad_block_lse = weight * (grad * (block_out.float() - out.transpose(1, 2).float())).sum(-1)
        grad_block_out = (grad * weight.unsqueeze(-1)).to(block_out.dtype)
        grads = torch.autograd.grad((block_out, block_lse), (q_, k_, v_),
                                    (grad_block_out, grad_block_lse.to(block_lse.dtype)))
    return tuple(g.transpose(1, 2) for g in grads)
