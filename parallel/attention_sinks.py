"""Attention sinks (gpt-oss) on any attention that gives its output and log-sum-exp.

A sink is one logit per head that joins every query's softmax and is then dropped: a key whose
value is zero. With (out, lse) the attention over the real keys,

    out' = out * sigmoid(lse - sink),  lse' = logaddexp(lse, sink)

so a kernel that returns its log-sum-exp (parallel/attention_blocks.py, the masked forms of
parallel/masked_attention.py, the ring's and the all-gather's merged results) needs nothing else:
under context parallelism the rescale happens once, after the merge. Backward from (out', lse'):
each kernel's own backward given the rescaled output and log-sum-exp gives dq, dk, dv exactly
(its probabilities exp(s - lse') and its row sums dO'.out' are those of the softmax with the sink),
and the sink's gradient is d sink = -sum over queries of exp(sink - lse') (dO'.out')."""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallel import masked_attention
from parallel.attention_blocks import block_attention, block_attention_backward, choose_block_kernel


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of out [batch, seq, heads, head_dim] and lse [batch, heads, seq] with one sink
    logit per head, sinks [heads]; lse' in the lse's precision (fp32 or better), out' in out's dtype."""
    merged = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    kept = (lse - merged).exp().transpose(1, 2).unsqueeze(-1)
    return (out.to(merged.dtype) * kept).to(out.dtype), merged


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sinks [heads] from the output's gradient and the rescaled out' and lse' (`merge_sinks`)."""
    compute = lse.dtype
    delta = (grad_out.to(compute) * out.to(compute)).sum(-1)  # [batch, seq, heads]
    share = (sinks.to(compute)[None, :, None] - lse).exp()    # [batch, heads, seq]: the sink's probability
    return -(share.transpose(1, 2) * delta).sum((0, 1)).to(sinks.dtype)


class _SinkAttention(torch.autograd.Function):
    """`attend(q, k, v) -> (out, lse, state)` with the sinks merged in; backward through
    `attend_backward(grad_out, q, k, v, out', lse', state) -> (dq, dk, dv)`."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, attend: Callable, attend_backward: Callable):
        out, lse, state = attend(q, k, v)
        out, lse = merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.state, ctx.attend_backward = state, attend_backward
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.attend_backward(grad_out, q, k, v, out, lse, ctx.state)
        return (grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), sinks_grad(grad_out, out, lse, sinks),
                None, None)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, attend: Callable,
                   attend_backward: Callable) -> torch.Tensor:
    """Attention of [batch, seq, heads, head_dim] inputs with a sink per head (sinks [heads]):
    `attend(q, k, v)` gives (out, lse [batch, heads, seq], state) over the real keys and
    `attend_backward(grad_out, q, k, v, out, lse, state)` its (dq, dk, dv) given the final out
    and lse (the contracts of parallel/attention_blocks.py)."""
    return _SinkAttention.apply(q, k, v, sinks, attend, attend_backward)



@torch.compiler.disable
def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, form=None,
                         scale: float | None = None) -> torch.Tensor:
    """Causal attention with sinks over a whole row (one device, tensor parallel, a2a context
    parallel): a fused block kernel (parallel/attention_blocks.py), or with a mask its form
    (dense, or FlexAttention's block mask: a mask for sinks is built without the variable-length
    kernel, which gives no log-sum-exp here). Outside compiled graphs, as the ring's kernels: the
    kernel choice reads SDPA's support checks."""
    if form is None:
        kernel = choose_block_kernel(q)

        def attend(q, k, v):
            return block_attention(kernel, q, k, v, True, scale)

        def attend_backward(grad_out, q, k, v, out, lse, state):
            return block_attention_backward(kernel, grad_out, q, k, v, out, lse, True, state)
    else:
        assert form.kernel != "varlen", "a mask read with attention sinks is built for a kernel that gives its lse"

        def attend(q, k, v):
            return (*masked_attention.block_forward(q, k, v, form, scale), None)

        def attend_backward(grad_out, q, k, v, out, lse, state):
            return masked_attention.block_backward(grad_out, q, k, v, out, lse, form, scale)
    return sink_attention(q, k, v, sinks, attend, attend_backward)
