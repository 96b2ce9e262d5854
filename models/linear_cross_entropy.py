"""The output projection and the summed cross-entropy in chunks of tokens, so that the logits of
the whole micro-batch ([tokens, vocab]: 4.2 GB in fp32 for 8,192 tokens of Llama 3's vocabulary)
never exist at once, in the forward or the backward:

    loss = linear_cross_entropy_sum(h, weight, labels, chunk_tokens=4096)
    # == F.cross_entropy(F.linear(h, weight).float().flatten(0, -2), labels.flatten(),
    #                    reduction="sum", ignore_index=-100)

Each chunk's logits are made in the compute dtype, reduced in fp32 (log-sum-exp, the label's
logit), and turned at once into the chunk's gradients: of its rows of `h`, and its share of the
weight's gradient, summed over the chunks in fp32. The gradients are computed in the forward (as
Liger's fused linear cross-entropy does) rather than by recomputing the logits in the backward (as
Cut Cross-Entropy does): the head's backward follows its forward at once, so keeping them costs
what a backward would allocate anyway (the weight's gradient, and a gradient of `h` where the
unfused path keeps `h`), and it saves a third GEMM over the vocabulary (the largest matmul of a
small model). The backward only scales them by the incoming gradient.

The chunk loop runs outside compiled graphs, with only each chunk's element-wise part (the loss
and the logits' gradient from the logits) compiled, once per chunk shape: traced as one graph,
the loop is unrolled (compile time grows with the chunks), and the compiler's partitioner is free
to keep each chunk's share of the weight gradient for the backward instead of their fp32 sum (it
did, for three chunks: half again the memory of the sum).

The same chunk loop serves a vocabulary split over tensor-parallel ranks
(`parallel.tensor_parallel.vocab_parallel_linear_cross_entropy_sum`): `combine` then merges each
rank's per-token statistics of its vocabulary slice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from models.errors import UserError

IGNORE_INDEX = -100

# (log-sum-exp of the logits, the label's logit or 0 where the label is not among them), each
# [chunk tokens] fp32, of this rank's vocabulary slice, and `group` -> the same two over the whole
# vocabulary. A module-level function: compiled code keeps it as a constant.
Combine = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


def check_chunk_tokens(chunk_tokens: int) -> None:
    if chunk_tokens < 0:
        raise UserError(f"--loss-chunk-tokens {chunk_tokens} must be >= 0 (0: the unfused output projection and "
                        f"loss; N: N tokens at a time)")


def logit_terms(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, combine: Combine | None,
                group: Any, gradients: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (its summed loss in fp32, d loss / d logits in the logits' dtype, or None
    without `gradients`) from logits [tokens, vocab slice] whose columns are vocabulary ids
    vocab_start, vocab_start + 1, ..., and labels [tokens]."""
    x = logits.float()
    vocab = x.shape[-1]
    local = labels - vocab_start
    here = (local >= 0) & (local < vocab)
    local = local.clamp(0, vocab - 1).unsqueeze(-1)
    label_logit = torch.where(here, x.gather(-1, local).squeeze(-1), 0.0)
    log_normalizer = torch.logsumexp(x, dim=-1)
    if combine is not None:
        log_normalizer, label_logit = combine(log_normalizer, label_logit, group)
    counted = labels != IGNORE_INDEX
    loss = torch.where(counted, log_normalizer - label_logit, 0.0).sum()
    if not gradients:
        return loss, None
    # softmax - one_hot(label) on counted rows, made in place of the fp32 logits (in eager, one
    # chunk of fp32 logits alive instead of several).
    grad = x.sub_(log_normalizer.unsqueeze(-1)).exp_().mul_(counted.unsqueeze(-1))
    grad.scatter_add_(-1, local, -(here & counted).unsqueeze(-1).to(grad.dtype))
    return loss, grad.to(logits.dtype)


def _loss_and_logit_gradients(logits, labels, vocab_start, combine, group):
    return logit_terms(logits, labels, vocab_start, combine, group, gradients=True)


def _loss_only(logits, labels, vocab_start, combine, group):
    return logit_terms(logits, labels, vocab_start, combine, group, gradients=False)


@functools.cache
def _compiled(gradients: bool):
    """`logit_terms` compiled (made on first use: making it imports the compiler), once per chunk
    shape: a micro-batch has at most two, the full chunk and the rest. Two functions of their own
    (not partials of one, whose compiled versions torch counts against one recompile limit)."""
    return torch.compile(_loss_and_logit_gradients if gradients else _loss_only, dynamic=False)


def chunked_loss_and_gradients(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                               *, vocab_start: int = 0, combine: Combine | None = None, group: Any = None,
                               gradients: bool = True, compile: bool = False):
    """(summed loss, d loss / d h, d loss / d weight in fp32) over chunks of `chunk_tokens`
    tokens; h [..., embed], weight [vocab (slice), embed], labels [...] with -100 ignored. Without
    `gradients` the two gradients are None; with `compile` each chunk's `logit_terms` is compiled."""
    if compile:
        terms = _compiled(gradients)
    else:
        terms = _loss_and_logit_gradients if gradients else _loss_only
    h_flat = h.reshape(-1, h.shape[-1])
    labels = labels.reshape(-1)
    loss = h_flat.new_zeros((), dtype=torch.float32)
    grad_h_chunks, grad_weight = [], None
    for start in range(0, h_flat.shape[0], chunk_tokens):
        h_chunk = h_flat[start:start + chunk_tokens]
        # Without autograd whatever the caller's grad mode (the gradients are made here), so that
        # the compiled terms see one grad mode.
        with torch.no_grad():
            chunk_loss, grad_logits = terms(h_chunk @ weight.t(), labels[start:start + chunk_tokens], vocab_start,
                                            combine, group)
        loss = loss + chunk_loss
        if not gradients:
            continue
        grad_h_chunks.append(grad_logits @ weight)
        if grad_weight is None:
            grad_weight = (grad_logits.t() @ h_chunk).float()
        elif grad_weight.dtype == h.dtype:
            grad_weight.addmm_(grad_logits.t(), h_chunk)
        else:
            # Summed over the chunks in fp32: a bf16 sum would round once per chunk.
            grad_weight.add_(grad_logits.t() @ h_chunk)
        del grad_logits  # before the next chunk's logits: one chunk's alive at a time
    if not gradients:
        return loss, None, None
    return loss, torch.cat(grad_h_chunks).view_as(h), grad_weight


class LinearCrossEntropySum(torch.autograd.Function):
    """`chunked_loss_and_gradients` as an autograd function: the gradients made in the forward
    are kept, and scaled by the loss's gradient in the backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                compile: bool, vocab_start: int, combine: Combine | None, group: Any):
        loss, grad_h, grad_weight = chunked_loss_and_gradients(h, weight, labels, chunk_tokens, vocab_start=vocab_start,
                                                               combine=combine, group=group, compile=compile)
        ctx.save_for_backward(grad_h, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        return *scaled_gradients(ctx, grad_loss), None, None, None, None, None, None


def scaled_gradients(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved (d loss / d h, d loss / d weight) times the incoming gradient, each in one pass
    that multiplies in fp32 (the loss's gradient, 1 / tokens say, rounded to bf16 would be off by
    up to 0.4%) and writes the gradient's dtype; out of place, so that a backward that runs twice
    (retain_graph) finds them as the forward left them."""
    grad_h, grad_weight = ctx.saved_tensors
    # A one-element tensor, not a 0-dim one, takes part in type promotion: the product is fp32.
    factor = grad_loss.float().reshape(1)
    return (torch.mul(grad_h, factor, out=torch.empty_like(grad_h)),
            torch.mul(grad_weight, factor, out=torch.empty_like(grad_weight, dtype=ctx.weight_dtype)))


@torch.compiler.disable
def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                             compile: bool = False, *, vocab_start: int = 0, combine: Combine | None = None,
                             group: Any = None) -> torch.Tensor:
    """Summed cross-entropy (fp32) of the logits h @ weight.T against `labels` (-100 ignored),
    `chunk_tokens` tokens at a time (the module docstring), outside compiled graphs; `compile`
    compiles each chunk's element-wise part. With a vocabulary split over ranks, `weight` holds
    rows vocab_start, vocab_start + 1, ... and `combine` merges the ranks' statistics over `group`."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return LinearCrossEntropySum.apply(h, weight, labels, chunk_tokens, compile, vocab_start, combine, group)
    # No backward will come (evaluation): no gradients to make.
    return chunked_loss_and_gradients(h, weight, labels, chunk_tokens, vocab_start=vocab_start, combine=combine,
                                      group=group, gradients=False, compile=compile)[0]
