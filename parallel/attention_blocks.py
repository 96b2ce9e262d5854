"""Attention over one block of queries and keys with a fused SDPA kernel that also returns the
block's log-sum-exp, so that blocks over disjoint keys merge exactly (`merge_into`) and each block's
backward, given the merged output and log-sum-exp, yields its exact share of the gradients. Context
parallelism builds on them: the ring (parallel/ring_attention.py) and the all-gather method
(parallel/context_parallel.py).

Kernels, as torch's own ring attention uses them: cuDNN (fastest on Hopper) or flash on CUDA, the CPU
flash kernel on CPU, so CPU tests run the same forward/backward structure as GPUs. fp32 math blocks
are the fallback where no fused kernel fits (fp32 on CUDA, head dims that are not multiples of 8).
The memory-efficient kernel is never used: it gives wrong dq/dk under load-balanced context
parallelism. Outputs and log-sum-exps merge in fp32.
"""

from __future__ import annotations

import torch
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# Block kernels on [batch, heads, seq, head_dim] tensors with equal head counts and head dims, the
# scores scaled by `scale`. forward(q, k, v, causal, scale) -> (out in q's dtype, lse fp32, state
# for backward); backward(grad_out, q, k, v, out, lse, causal, state, scale) -> (dq, dk, dv).
# Causal blocks are square.


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (seed, offset)


def _cudnn_backward(grad_out, q, k, v, out, lse, causal, state, scale):
    seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale,
    )


def _flash_forward(q, k, v, causal, scale):
    out, lse, _, _, _, _, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (rng_state, unused)


def _flash_backward(grad_out, q, k, v, out, lse, causal, state, scale):
    rng_state, unused = state
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng_state, unused,
        scale=scale,
    )


def _flash_cpu_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _flash_cpu_backward(grad_out, q, k, v, out, lse, causal, state, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                     scale=scale)


def _math_scores(q, k, causal, scale):
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(compute) @ k.to(compute).transpose(-1, -2) * scale
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _math_forward(q, k, v, causal, scale):
    scores = _math_scores(q, k, causal, scale)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.to(scores.dtype)
    return out.to(q.dtype), lse, None


def _math_backward(grad_out, q, k, v, out, lse, causal, state, scale):
    probs = (_math_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    grad_out = grad_out.to(probs.dtype)
    delta = (grad_out * out.to(probs.dtype)).sum(-1, keepdim=True)
    grad_scores = probs * (grad_out @ v.to(probs.dtype).transpose(-1, -2) - delta) * scale
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


def to_kernel_layout(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, seq, n, head_dim] -> [batch, heads, seq, head_dim], each of the n heads repeated for
    its group of query heads (adjacent, as in SDPA's enable_gqa), dense in the usual BSHD layout."""
    batch, seq, num_heads, head_dim = t.shape
    if num_heads != heads:
        t = t.unsqueeze(3).expand(batch, seq, num_heads, heads // num_heads, head_dim).flatten(2, 3)
    return t.contiguous().transpose(1, 2)


def block_attention(kernel: str, q, k, v, causal: bool, scale: float | None = None):
    """out [batch, seq_q, heads, head_dim] in q's dtype, lse [batch, heads, seq_q] (fp32 for 16- and
    32-bit inputs) and the state that `block_attention_backward` needs. `scale` multiplies the
    scores (None: head_dim ** -0.5)."""
    heads = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse, state = _KERNELS[kernel][0](*(to_kernel_layout(t, heads) for t in (q, k, v)), causal, scale)
    # cuDNN's lse is [batch, heads, seq, 1], flash's [batch, heads, seq]: backward gets the same rank.
    return out.transpose(1, 2), lse.reshape(lse.shape[:3]), (state, lse.dim(), scale)


def block_attention_backward(kernel: str, grad_out, q, k, v, out, lse, causal: bool, state):
    """dq [batch, seq_q, heads, head_dim] and dk, dv [batch, seq_k, kv_heads, head_dim] of one block,
    given the final out and lse of the whole attention: with them the block's probabilities are its
    true share of each row's softmax. dk and dv are summed over each kv head's query heads in the
    lse's precision."""
    heads, kv_heads = q.shape[2], k.shape[2]
    kernel_state, lse_dim, scale = state
    lse = lse.contiguous()
    if lse_dim == 4:
        lse = lse.unsqueeze(-1)
    tensors = (to_kernel_layout(t, heads) for t in (grad_out, q, k, v, out))
    grad_q, grad_k, grad_v = (g.transpose(1, 2) for g in _KERNELS[kernel][1](*tensors, lse, causal, kernel_state, scale))
    if kv_heads != heads:
        grad_k, grad_v = (g.to(lse.dtype).unflatten(2, (kv_heads, heads // kv_heads)).sum(3) for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v


def merge_into(out, lse, block_out, block_lse) -> None:
    """In place: combine two partial softmax results over disjoint keys by their log-sum-exps.
    out and block_out are [batch, seq, heads, head_dim], lse and block_lse [batch, heads, seq]."""
    merged_lse = torch.logaddexp(lse, block_lse)

    def weight(x):  # [batch, heads, seq] -> [batch, seq, heads, 1]
        return x.transpose(1, 2).unsqueeze(-1)

    out.mul_(weight((lse - merged_lse).exp())).add_(block_out * weight((block_lse - merged_lse).exp()))
    lse.copy_(merged_lse)
