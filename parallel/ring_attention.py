"""Ring context-parallel attention: K/V blocks travel round the cp ranks while the previous block is
attended to; partial results merge by log-sum-exp; in backward dK/dV travel round with them back to
their owner. Layout and load balancing are parallel/context_parallel.py's (rank i holds sequence
chunks i and 2*cp-1-i).

Each block runs a fused SDPA kernel that also returns its log-sum-exp, as torch's own ring attention
does: cuDNN (fastest on Hopper) or flash on CUDA, the CPU flash kernel on CPU, so CPU tests run the
same forward/backward structure as GPUs. fp32 math blocks are the fallback where no fused kernel
fits (fp32 on CUDA, head dims that are not multiples of 8). The memory-efficient kernel is never used:
it gives wrong dq/dk under load-balanced context parallelism. Outputs and log-sum-exps merge in fp32;
each block's backward gets the merged output and log-sum-exp, so its gradients are its exact share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# Block kernels on [batch, heads, seq, head_dim] tensors with equal head counts and scale
# head_dim ** -0.5. forward(q, k, v, causal) -> (out in q's dtype, lse fp32, state for backward);
# backward(grad_out, q, k, v, out, lse, causal, state) -> (dq, dk, dv). Causal blocks are square.


def _cudnn_forward(q, k, v, causal):
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False
    )
    return out, lse, (seed, offset)


def _cudnn_backward(grad_out, q, k, v, out, lse, causal, state):
    seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal
    )


def _flash_forward(q, k, v, causal):
    out, lse, _, _, _, _, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    return out, lse, (rng_state, unused)


def _flash_backward(grad_out, q, k, v, out, lse, causal, state):
    rng_state, unused = state
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng_state, unused
    )


def _flash_cpu_forward(q, k, v, causal):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def _flash_cpu_backward(grad_out, q, k, v, out, lse, causal, state):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)


def _math_scores(q, k, causal):
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _math_forward(q, k, v, causal):
    scores = _math_scores(q, k, causal)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.to(scores.dtype)
    return out.to(q.dtype), lse, None


def _math_backward(grad_out, q, k, v, out, lse, causal, state):
    probs = (_math_scores(q, k, causal) - lse.unsqueeze(-1)).exp()
    grad_out = grad_out.to(probs.dtype)
    delta = (grad_out * out.to(probs.dtype)).sum(-1, keepdim=True)
    grad_scores = probs * (grad_out @ v.to(probs.dtype).transpose(-1, -2) - delta) * q.shape[-1] ** -0.5
    grad_q = grad_scores @ k.to(probs.dtype)
    grad_k = grad_scores.transpose(-1, -2) @ q.to(probs.dtype)
    grad_v = probs.transpose(-1, -2) @ grad_out
    return tuple(g.to(q.dtype) for g in (grad_q, grad_k, grad_v))


_KERNELS = {
    "cudnn": (_cudnn_forward, _cudnn_backward),
    "flash": (_flash_forward, _flash_backward),
    "flash_cpu": (_flash_cpu_forward, _flash_cpu_backward),
    "math": (_math_forward, _math_backward),
}
BLOCK_KERNELS = tuple(_KERNELS)


def choose_block_kernel(q: torch.Tensor) -> str:
    """The fastest block kernel for these queries [batch, seq, heads, head_dim], by SDPA's own support
    checks on the diagonal block's shapes (K/V heads expanded to the query heads, causal)."""
    if q.device.type == "cpu":
        return "flash_cpu"
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:
        q_kernel = q.transpose(1, 2)
        params = SDPAParams(q_kernel, q_kernel, q_kernel, None, 0.0, True, False)
        if can_use_cudnn_attention(params):
            return "cudnn"
        if can_use_flash_attention(params):
            return "flash"
    return "math"


def _to_kernel(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, seq, n, head_dim] -> [batch, heads, seq, head_dim], each of the n heads repeated for
    its group of query heads (adjacent, as in SDPA's enable_gqa), dense in the usual BSHD layout."""
    batch, seq, num_heads, head_dim = t.shape
    if num_heads != heads:
        t = t.unsqueeze(3).expand(batch, seq, num_heads, heads // num_heads, head_dim).flatten(2, 3)
    return t.contiguous().transpose(1, 2)


def _block_attention(kernel: str, q, k, v, causal: bool):
    """out [batch, seq_q, heads, head_dim] in q's dtype, lse [batch, heads, seq_q] (fp32 for 16- and
    32-bit inputs) and the state that `_block_attention_backward` needs."""
    heads = q.shape[2]
    out, lse, state = _KERNELS[kernel][0](*(_to_kernel(t, heads) for t in (q, k, v)), causal)
    # cuDNN's lse is [batch, heads, seq, 1], flash's [batch, heads, seq]: backward gets the same rank.
    return out.transpose(1, 2), lse.reshape(lse.shape[:3]), (state, lse.dim())


def _block_attention_backward(kernel: str, grad_out, q, k, v, out, lse, causal: bool, state):
    """dq [batch, seq_q, heads, head_dim] and dk, dv [batch, seq_k, kv_heads, head_dim] of one block,
    given the final out and lse of the whole attention: with them the block's probabilities are its
    true share of each row's softmax. dk and dv are summed over each kv head's query heads in the
    lse's precision."""
    heads, kv_heads = q.shape[2], k.shape[2]
    kernel_state, lse_dim = state
    lse = lse.contiguous()
    if lse_dim == 4:
        lse = lse.unsqueeze(-1)
    tensors = (_to_kernel(t, heads) for t in (grad_out, q, k, v, out))
    grad_q, grad_k, grad_v = (g.transpose(1, 2) for g in _KERNELS[kernel][1](*tensors, lse, causal, kernel_state))
    if kv_heads != heads:
        grad_k, grad_v = (g.to(lse.dtype).unflatten(2, (kv_heads, heads // kv_heads)).sum(3) for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v


def _merge_into(out, lse, block_out, block_lse) -> None:
    """In place: combine two partial softmax results over disjoint keys by their log-sum-exps.
    out and block_out are [batch, seq, heads, head_dim], lse and block_lse [batch, heads, seq]."""
    merged_lse = torch.logaddexp(lse, block_lse)

    def weight(x):  # [batch, heads, seq] -> [batch, seq, heads, 1]
        return x.transpose(1, 2).unsqueeze(-1)

    out.mul_(weight((lse - merged_lse).exp())).add_(block_out * weight((block_lse - merged_lse).exp()))
    lse.copy_(merged_lse)


# ---------------------------------------------------------------------------------------------


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
    def forward(ctx, q, k, v, group, kernel):
        ring, rank, cp_size = _RingShift(group), dist.get_rank(group), dist.get_world_size(group)
        half = q.shape[1] // 2
        kv = torch.stack([k, v])
        out = lse = state = None
        for step in range(cp_size):
            source = (rank - step) % cp_size
            # Issue the next block's transfer before this block's attention so the two overlap.
            pending = ring.start(kv, _KV_TAG) if step + 1 < cp_size else None
            block_k, block_v = kv
            if step == 0:
                block_out, lse, state = _block_attention(kernel, q, block_k, block_v, causal=True)
                out = block_out.to(lse.dtype).contiguous()  # the merge accumulates in the lse's precision
            elif source < rank:
                block = _block_attention(kernel, q, block_k[:, :half], block_v[:, :half], causal=False)
                _merge_into(out, lse, *block[:2])
            else:
                block = _block_attention(kernel, q[:, half:], block_k, block_v, causal=False)
                _merge_into(out[:, half:], lse[:, :, half:], *block[:2])
            if pending is not None:
                kv = ring.finish(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.state = group, kernel, state
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, rank, cp_size = _RingShift(ctx.group), dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        half = q.shape[1] // 2

        def block_backward(grad_out, q, k, v, out, lse, causal):
            return _block_attention_backward(ctx.kernel, grad_out, q, k, v, out, lse, causal, ctx.state)

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
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def ring_attention(q, k, v, group: dist.ProcessGroup, *, kernel: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced queries over the whole sequence, by the ring.

    q [batch, local_seq, heads, head_dim], k and v [batch, local_seq, kv_heads, head_dim] in
    `shard_sequence` order, local_seq even. kernel: one of BLOCK_KERNELS, or None for
    `choose_block_kernel(q)`; cuDNN and flash need CUDA, fp16/bf16 and a supported head_dim."""
    kernel = kernel or choose_block_kernel(q)
    if kernel not in _KERNELS:
        raise ValueError(f"unknown ring attention block kernel {kernel!r}; use one of {', '.join(BLOCK_KERNELS)}")
    return _RingAttention.apply(q, k, v, group, kernel)
