"""Context-parallel causal attention: every sample's sequence split over the ranks of a cp group.

Causal load balancing: the sequence is cut into 2*cp chunks and cp rank i holds chunks i and
2*cp-1-i (in that order), so every rank has one early (cheap) and one late (costly) chunk of queries
and all ranks do the same attention work. Three ways to attend over the whole sequence:

- allgather: gather every rank's K/V; each query chunk attends to the chunks before it in one block
  and to itself causally, merged by log-sum-exp; backward reduce-scatters dK/dV.
- ring (parallel/ring_attention.py): K/V blocks travel round the ring while the previous block is
  attended to; partial results merge by log-sum-exp; in backward dK/dV travel round the ring with them
  back to their owner.
- a2a (Ulysses): all-to-all from sequence shards to head shards, full causal attention, all-to-all back.

With packed documents, a sliding window or chunks (a models.masking.AttentionMask) each method
keeps its communication and attends with the mask's form for its call sites (`mask_sites`):
all-gather, this rank's query positions against every key in one masked call; a2a, the whole row as
on one device; the ring, each of its blocks, skipping blocks where no query sees a key
(parallel/masked_attention.py). Chunks keep their global positions, so the documents and the load
balance stay as they are. Attention sinks (parallel/attention_sinks.py) rescale the merged output
once, after the all-gather's or the ring's blocks are merged; under a2a each rank takes the sinks of
the heads it holds.

torch's own `context_parallel()` only intercepts CUDA SDPA ops (no CPU path), hence this module: it
runs on CPU (what the tests check) and on CUDA. The all-gather and ring methods call the fused
kernels that also return each block's log-sum-exp (parallel/attention_blocks.py: cuDNN or flash on
CUDA, the CPU flash kernel on CPU; fp32 math where none fits); a2a runs SDPA limited to the cuDNN,
flash and math kernels. The memory-efficient kernel is never allowed: it gives wrong dq/dk under
load-balanced context parallelism.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.errors import UserError
from models.masking import AttentionMask
from parallel import masked_attention
from parallel.attention_blocks import block_attention, block_attention_backward, choose_block_kernel, merge_into
from parallel.attention_sinks import attention_with_sinks, merge_sinks, sink_attention, sinks_grad
from parallel.ring_attention import ring_attention, ring_site

# Mask sites (see `mask_sites`): the whole row in order, and one rank's chunks over all keys.
WHOLE_ROW, GATHERED = "whole_row", "gathered"

CP_METHODS = ("allgather", "ring", "a2a")

# Kept here rather than imported from parallel.context, which dispatches to this module.
_CUDA_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

# torch 2.13 renamed all_gather_tensor* to all_gather_single* (the old names warn); 2.11 has only the old.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _check_sequence_splits(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise UserError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp_size} (load-balanced context "
            f"parallelism cuts it into 2 x cp chunks); make the sequence length a multiple of {2 * cp_size}"
        )


def load_balance_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by cp_rank (chunks i and 2cp-1-i); int64 [seq_len // cp_size]."""
    _check_sequence_splits(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    chunk = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)])


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced part of a full-sequence tensor (tokens, labels, positions)."""
    _check_sequence_splits(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim)


def _rank_major_positions(seq_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """Global position of each row of a sequence gathered rank after rank (rank 0's tokens first)."""
    positions = [load_balance_indices(seq_len, cp_size, rank) for rank in range(cp_size)]
    return torch.cat(positions).to(device)


def mask_sites(method: str, seq_len: int, cp_size: int, cp_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (query positions, key positions) of every masked attention call `method` makes on this
    rank, by site name; positions are global positions in the row."""
    whole = torch.arange(seq_len)
    if cp_size == 1 or method == "a2a":
        return {WHOLE_ROW: (whole, whole)}
    local = load_balance_indices(seq_len, cp_size, cp_rank)
    if method == "allgather":
        return {GATHERED: (local, whole)}
    # The ring's blocks (parallel/ring_attention.py): its own K/V at step 0; then an earlier rank's
    # early chunk for all local queries, or a later rank's whole K/V for the local late chunk.
    half = len(local) // 2
    sites = {ring_site(0): (local, local)}
    for step in range(1, cp_size):
        source = (cp_rank - step) % cp_size
        keys = load_balance_indices(seq_len, cp_size, source)
        sites[ring_site(step)] = (local, keys[:half]) if source < cp_rank else (local[half:], keys)
    return sites


def _kernel_choice(device: torch.device):
    if device.type == "cuda":
        return sdpa_kernel(_CUDA_SDPA_BACKENDS, set_priority=True)
    return contextlib.nullcontext()


def _causal_sdpa(q, k, v, scale) -> torch.Tensor:
    """Causal SDPA on [batch, seq, heads, head_dim] tensors, GQA by head groups, never the efficient kernel."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with _kernel_choice(q.device):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1],
                                             scale=scale)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# allgather: every rank sees all K/V; per-chunk causal masks in global positions.


def _allgather_attention(q, k, v, group, cp_size: int, scale, mask: AttentionMask | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    batch, local_seq, _, head_dim = q.shape
    kv_heads, seq_len = k.shape[2], local_seq * cp_size
    # One collective for K and V; under GQA only the kv heads travel. Its autograd backward is a
    # reduce-scatter: each rank gets the dK/dV that all ranks' queries gave its tokens.
    kv = torch.cat([k, v], dim=2).contiguous()
    gathered = _all_gather_autograd(kv, 0, group)  # [cp * batch, local_seq, 2 * kv_heads, head_dim]
    gathered = gathered.view(cp_size, batch, local_seq, 2 * kv_heads, head_dim).transpose(0, 1)
    gathered = gathered.reshape(batch, seq_len, 2 * kv_heads, head_dim)
    kv_global = gathered.index_select(1, torch.argsort(_rank_major_positions(seq_len, cp_size, q.device)))
    k_all, v_all = kv_global.split(kv_heads, dim=2)
    if mask is not None and sinks is not None:
        form = mask.forms[GATHERED]
        return sink_attention(q, k_all, v_all, sinks, lambda q, k, v: (*masked_attention.block_forward(q, k, v, form, scale), None),
                              lambda g, q, k, v, out, lse, _: masked_attention.block_backward(g, q, k, v, out, lse, form, scale))
    if mask is not None:
        return masked_attention.attend(q, k_all, v_all, mask.forms[GATHERED], scale)

    # This rank's queries are chunks `rank` and `2 * cp - 1 - rank` of the sequence.
    rank = dist.get_rank(group)
    return _attend_own_chunks(q, k_all, v_all, (rank, 2 * cp_size - 1 - rank), scale, sinks)


@torch.compiler.disable
def _attend_own_chunks(q, k_all, v_all, chunk_indices: tuple[int, int], scale, sinks=None) -> torch.Tensor:
    """Outside compiled graphs, as the ring's block loop is: the kernel choice reads SDPA's support
    checks (which a graph cannot hold), and the block kernels run as they are, already fused."""
    return _ChunksOverGatheredKV.apply(q, k_all, v_all, chunk_indices, choose_block_kernel(q), scale, sinks)


class _ChunksOverGatheredKV(torch.autograd.Function):
    """This rank's two query chunks over the whole sequence's K/V (in global order). Query chunk c
    sees the keys of chunks 0..c-1 in full (one block) and its own chunk causally (the diagonal
    block); keys past it are left out. The blocks run fused kernels (cuDNN on Hopper) and merge by
    log-sum-exp, then take the sinks in where there are; backward gives each block's kernel the
    merged output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, chunk_indices: tuple[int, int], kernel: str, scale, sinks=None):
        chunk = q.shape[1] // 2
        outputs, lses, state = [], [], None
        for half, index in enumerate(chunk_indices):
            q_chunk, start = q[:, half * chunk:(half + 1) * chunk], index * chunk
            diagonal = slice(start, start + chunk)
            out, lse, state = block_attention(kernel, q_chunk, k_all[:, diagonal], v_all[:, diagonal], causal=True,
                                              scale=scale)
            out = out.to(lse.dtype).contiguous()  # merged in the lse's precision
            if start:
                past = block_attention(kernel, q_chunk, k_all[:, :start], v_all[:, :start], causal=False, scale=scale)
                merge_into(out, lse, *past[:2])
            outputs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outputs, dim=1), torch.cat(lses, dim=2)
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_all, v_all, out, lse, sinks)
        ctx.chunk_indices, ctx.kernel, ctx.state = chunk_indices, kernel, state
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_all, v_all, out, lse, sinks = ctx.saved_tensors
        chunk = q.shape[1] // 2
        # fp32 (or better) accumulators: a key's gradient sums blocks of both query chunks.
        grad_q, grad_k, grad_v = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (q, k_all, v_all))
        for half, index in enumerate(ctx.chunk_indices):
            rows, start = slice(half * chunk, (half + 1) * chunk), index * chunk
            blocks = [(slice(start, start + chunk), True)] + ([(slice(0, start), False)] if start else [])
            for keys, causal in blocks:
                dq, dk, dv = block_attention_backward(ctx.kernel, grad_out[:, rows], q[:, rows], k_all[:, keys],
                                                      v_all[:, keys], out[:, rows], lse[:, :, rows], causal, ctx.state)
                grad_q[:, rows] += dq
                grad_k[:, keys] += dk
                grad_v[:, keys] += dv
        grad_sinks = sinks_grad(grad_out, out, lse, sinks) if sinks is not None else None
        return grad_q.to(q.dtype), grad_k.to(k_all.dtype), grad_v.to(v_all.dtype), None, None, None, grad_sinks


# ---------------------------------------------------------------------------------------------
# a2a (Ulysses): trade the sequence split for a head split and back.


def _check_heads_split(heads: int, kv_heads: int, cp_size: int) -> None:
    if heads % cp_size or kv_heads % cp_size:
        raise UserError(
            f"a2a context parallelism splits the heads over cp={cp_size} ranks, but the model has {heads} "
            f"query heads and {kv_heads} KV heads; use a cp that divides both, or method 'allgather' or 'ring'"
        )


def _a2a_attention(q, k, v, group, cp_size: int, scale, mask: AttentionMask | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    batch, local_seq, heads, head_dim = q.shape
    kv_heads, seq_len = k.shape[2], local_seq * cp_size

    def grouped_by_destination(t):  # [cp, batch, local_seq, heads_of_t / cp, head_dim]
        return t.reshape(batch, local_seq, cp_size, t.shape[2] // cp_size, head_dim).permute(2, 0, 1, 3, 4)

    # q, k and v travel in one all-to-all; rank j receives every rank's tokens for its head group j.
    packed = torch.cat([grouped_by_destination(t) for t in (q, k, v)], dim=3).contiguous()
    received = funcol.all_to_all_single_autograd(packed, None, None, group)
    received = received.permute(1, 0, 2, 3, 4).reshape(batch, seq_len, -1, head_dim)
    # Tokens arrive rank after rank in load-balanced order; in global order plain causal attention applies.
    rank_major = _rank_major_positions(seq_len, cp_size, q.device)
    received = received.index_select(1, torch.argsort(rank_major))
    q_heads, k_heads, v_heads = received.split([heads // cp_size, kv_heads // cp_size, kv_heads // cp_size], dim=2)
    if sinks is not None:  # the sinks of this rank's heads: their gradients sum over cp, each from one rank
        rank, local_heads = dist.get_rank(group), heads // cp_size
        form = mask.forms[WHOLE_ROW] if mask is not None else None
        out = attention_with_sinks(q_heads, k_heads, v_heads, sinks[rank * local_heads:(rank + 1) * local_heads],
                                   form, scale)
    elif mask is None:
        out = _causal_sdpa(q_heads, k_heads, v_heads, scale)  # [batch, seq, heads / cp, head_dim]
    else:
        out = masked_attention.attend(q_heads, k_heads, v_heads, mask.forms[WHOLE_ROW], scale)

    out = out.index_select(1, rank_major).reshape(batch, cp_size, local_seq, heads // cp_size, head_dim)
    out = funcol.all_to_all_single_autograd(out.transpose(0, 1).contiguous(), None, None, group)
    return out.permute(1, 2, 0, 3, 4).reshape(batch, local_seq, heads, head_dim)


# ---------------------------------------------------------------------------------------------


def context_parallel_attention(q, k, v, *, group: dist.ProcessGroup, method: str,
                               mask: AttentionMask | None = None, scale: float | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence of the cp group.

    q [batch, local_seq, heads, head_dim], k and v [batch, local_seq, kv_heads, head_dim] hold this
    rank's tokens in `shard_sequence` order; v may have a head_dim of its own (MLA), which the
    output has. `mask` limits the keys (its forms built for this method's `mask_sites` on this
    rank); `scale` multiplies the scores (None: q's head_dim ** -0.5); `sinks` [heads] are
    attention sinks (parallel/attention_sinks.py).
    method in ("allgather", "ring", "a2a"); raises models.errors.UserError for an unknown method
    and for a2a when heads or kv_heads are not divisible by cp."""
    if method not in CP_METHODS:
        raise UserError(f"unknown context-parallel attention method {method!r}; use one of {', '.join(CP_METHODS)}")
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise UserError(f"{heads} query heads are not a multiple of {kv_heads} KV heads; change num_kv_heads")
    cp_size = dist.get_world_size(group)
    if method == "a2a":
        _check_heads_split(heads, kv_heads, cp_size)
    if q.shape[1] % 2:
        raise UserError(
            f"local sequence length {q.shape[1]} is odd; the sequence must be a multiple of 2 x cp = {2 * cp_size}"
        )
    if cp_size == 1:  # one rank holds chunks 0 and 1: the sequence in its own order
        if sinks is not None:
            return attention_with_sinks(q, k, v, sinks, mask.forms[WHOLE_ROW] if mask is not None else None, scale)
        if mask is not None:
            return masked_attention.attend(q, k, v, mask.forms[WHOLE_ROW], scale)
        return _causal_sdpa(q, k, v, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Every method moves K and V as one tensor and attends on kernels with one head dim: where V's
    # differs (MLA), the smaller side is padded with zeros, which changes neither the scores nor
    # the output's first value_dim dims (nor their gradients), and the output is cut back after.
    value_dim, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
    q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    if method == "allgather":
        out = _allgather_attention(q, k, v, group, cp_size, scale, mask, sinks)
    elif method == "a2a":
        out = _a2a_attention(q, k, v, group, cp_size, scale, mask, sinks)
    else:
        out = ring_attention(q, k, v, group, forms=None if mask is None else mask.forms, scale=scale, sinks=sinks)
    return out if value_dim == width else out[..., :value_dim]
