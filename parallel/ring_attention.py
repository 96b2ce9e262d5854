"""Ring context-parallel attention: K/V blocks travel round the cp ranks while the previous block is
attended to; partial results merge by log-sum-exp; in backward dK/dV travel round with them back to
their owner. Layout and load balancing are parallel/context_parallel.py's (rank i holds sequence
chunks i and 2*cp-1-i). Each block runs a fused kernel of parallel/attention_blocks.py, or with a
mask (documents, a sliding window) the block's form of parallel/masked_attention.py; a masked block
where no query sees a key is skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import masked_attention
from parallel.attention_blocks import (BLOCK_KERNELS, block_attention, block_attention_backward,
                                       choose_block_kernel, merge_into)
from parallel.attention_sinks import merge_sinks, sinks_grad


def ring_site(step: int) -> str:
    """The name of step `step`'s block among a mask's forms (parallel/context_parallel.py builds them)."""
    return f"ring{step}"


class _RingShift:
    """Sends a tensor to the next rank of the ring and receives the previous rank's, asynchronously."""

    def __init__(self, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.previous_rank = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensor: torch.Tensor, tag: int):
        received = torch.empty_like(tensor)
        # Distinct tags keep K/V and dK/dV messages apart where both are in flight (gloo matches by tag).
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, received, self.previous_rank, self.group, tag),
        ])
        return works, received

    @staticmethod
    def finish(pending) -> torch.Tensor:
        works, received = pending
        for work in works:
            work.wait()
        return received


_KV_TAG, _GRAD_KV_TAG = 0, 1


class _RingAttention(torch.autograd.Function):
    """At step s rank r holds the K/V of rank (r - s) mod cp. Against its own K/V a rank's queries are
    plain causal (its two chunks are in global order); against an earlier rank's (source < r), all local
    queries see only that rank's early chunk; against a later rank's, only the local late chunk sees
    anything, and it sees both chunks. So after the diagonal every step is the same half-size block.
    K and V travel stacked as one [2, batch, seq, kv_heads, head_dim] tensor (only the kv heads)."""

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, forms, scale, sinks=None):
        ring, rank, cp_size = _RingShift(group), dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[1] // 2
        kv = torch.stack([k, v])
        out = lse = state = None

        def attend(step, q, k, v, causal):
            if forms is None:
                return block_attention(kernel, q, k, v, causal, scale)
            return (*masked_attention.block_forward(q, k, v, forms[ring_site(step)], scale), None)

        for step in range(cp_size):
            source = (rank - step) % cp_size
            # Issue the next block's transfer before this block's attention so the two overlap.
            pending = ring.start(kv, _KV_TAG) if step + 1 < cp_size else None
            block_k, block_v = kv
            if step == 0:
                block_out, lse, state = attend(step, q, block_k, block_v, causal=True)
                out = block_out.to(lse.dtype).contiguous()  # the merge accumulates in the lse's precision
            elif forms is not None and forms[ring_site(step)].empty:
                pass  # no query here sees a key of this block (other documents, out of the window)
            elif source < rank:
                block = attend(step, q, block_k[:, :half], block_v[:, :half], causal=False)
                merge_into(out, lse, *block[:2])
            else:
                block = attend(step, q[:, half:], block_k, block_v, causal=False)
                merge_into(out[:, half:], lse[:, :, half:], *block[:2])
            if pending is not None:
                kv = ring.finish(pending)
        if sinks is not None:  # once, on the merged result
            out, lse = merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.kernel, ctx.state, ctx.forms, ctx.scale = group, kernel, state, forms, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring, rank, cp_size = _RingShift(ctx.group), dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        half = q.shape[1] // 2

        forms = ctx.forms

        def block_backward(grad_out, q, k, v, out, lse, causal):
            if forms is not None:
                return masked_attention.block_backward(grad_out, q, k, v, out, lse, forms[ring_site(step)], ctx.scale)
            return block_attention_backward(ctx.kernel, grad_out, q, k, v, out, lse, causal, ctx.state)

        grad_q = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = torch.stack([k, v])
        pending_grad_kv = None
        for step in range(cp_size):
            source = (rank - step) % cp_size
            pending_kv = ring.start(kv, _KV_TAG) if step + 1 < cp_size else None
            block_k, block_v = kv
            # fp32 (or better) so that the cp partial sums of dK/dV do not round on the way.
            grad_kv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
            grad_k, grad_v = grad_kv
            if step == 0:
                block = block_backward(grad_out, q, block_k, block_v, out, lse, causal=True)
                grad_q += block[0]
                grad_k += block[1]
                grad_v += block[2]
            elif forms is not None and forms[ring_site(step)].empty:
                pass  # the block was skipped forward: it has no gradient, but the ring still carries dK/dV
            elif source < rank:
                block = block_backward(grad_out, q, block_k[:, :half], block_v[:, :half], out, lse, causal=False)
                grad_q += block[0]
                grad_k[:, :half] += block[1]
                grad_v[:, :half] += block[2]
            else:
                block = block_backward(
                    grad_out[:, half:], q[:, half:], block_k, block_v, out[:, half:], lse[:, :, half:], causal=False
                )
                grad_q[:, half:] += block[0]
                grad_k += block[1]
                grad_v += block[2]
            # The dK/dV of this block's owner arrive from the previous rank, which held it a step ago;
            # add ours and pass them on. After the last step the next send brings them home.
            if pending_grad_kv is not None:
                grad_kv += ring.finish(pending_grad_kv)
            pending_grad_kv = ring.start(grad_kv, _GRAD_KV_TAG)
            if pending_kv is not None:
                kv = ring.finish(pending_kv)
        grad_k, grad_v = ring.finish(pending_grad_kv)
        grad_sinks = sinks_grad(grad_out, out, lse, sinks) if sinks is not None else None
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, grad_sinks


def ring_attention(q, k, v, group: dist.ProcessGroup, *, kernel: str | None = None,
                   forms: dict | None = None, scale: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence, by the ring.

    q [batch, local_seq, heads, head_dim], k and v [batch, local_seq, kv_heads, head_dim] in
    `shard_sequence` order, local_seq even. kernel: one of BLOCK_KERNELS, or None for
    `choose_block_kernel(q)`; cuDNN and flash need CUDA, fp16/bf16 and a supported head_dim.
    forms: a mask's forms by `ring_site(step)`, for attention within documents or a window. `scale`
    multiplies the scores (None: head_dim ** -0.5). `sinks` [heads]: attention sinks, merged once
    after the ring's blocks (parallel/attention_sinks.py)."""
    kernel = kernel or choose_block_kernel(q)
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"unknown ring attention block kernel {kernel!r}; use one of {', '.join(BLOCK_KERNELS)}")
    return _RingAttention.apply(q, k, v, group, kernel, forms, scale, sinks)
