"""Tensor + sequence parallelism whose communication hides behind the matmuls.

Under sequence parallelism the residual stream is split over tp along the sequence. A
column-parallel matmul (q/k/v, gate/up, the output head: weight split on its output dim) needs the
whole sequence, and a row-parallel one (wo, w_down: weight split on its input dim) gives partial
sums that are reduce-scattered back onto sequence shards. Done as separate collectives, the GPU
waits for each. Here they are fused with the matmul that consumes or produces them:

    all_gather_matmul(x_shard, [w.t() for w in weights])   # one gather for q, k and v
    matmul_reduce_scatter([(h, w.t())])                     # wo's output straight to its shard

and each is the other's backward: d(input) of the gathered matmul is a matmul + reduce-scatter of
the output gradients, d(input) of the scattered matmul a gathered matmul of the output gradient.

Two ways to run them (`OVERLAP_METHODS`):
- `symm_mem` (CUDA): torch's symmetric-memory ops `fused_all_gather_matmul` and
  `fused_matmul_reduce_scatter`, which copy shards between GPUs over NVLink while the matmul of
  the shard already there runs, on two streams.
- `chunked` (any device, the CPU test path): the sequence is cut into tp chunks; on GPUs one
  chunk's all-gather (reduce-scatter) is in flight while another chunk's matmuls run, one
  collective at a time, and the rows this rank holds are multiplied before any data has arrived.
  On gloo each collective is waited on at once (`_overlaps`); the order of the work is the same.

The gathered matmul saves its gathered input for the weight gradient rather than gathering it
again in backward: that is the memory the unfused path (and TP without SP) keeps as well, and a
second gather would put one more collective on the backward's critical path.

Layout: activations are [batch, seq, features] with the sequence split over tp on dim 1 (shards
of equal length). Gathered tensors come back as [batch, seq, features] views of sequence-major
storage, the layout torch's fused ops produce; token-wise math (`_tokens`) reads both layouts.
"""

from __future__ import annotations

import importlib

import warnings
from typing import NamedTuple

import torch

from models.errors import UserError
from models.linear_cross_entropy import linear_cross_entropy_sum

OVERLAP_CHOICES = ("auto", "symm_mem", "chunked", "none")
OVERLAP_METHODS = ("symm_mem", "chunked")
SEQ_DIM = 1

_c10d = torch.ops._c10d_functional


class TpGroup(NamedTuple):
    """The tp process group as compiled code can carry it: plain constants."""

    name: str
    size: int
    rank: int


def symm_mem_available() -> bool:
    """Whether this torch build has the fused symmetric-memory matmuls (CUDA builds)."""
    if not torch.cuda.is_available():
        return False
    try:
        # Registers torch.ops.symm_mem. (An `import torch.x` here would make `torch` local.)
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")


def resolve_method(choice: str, *, sequence_parallel: bool, tp: int, device_type: str,
                   async_tp: bool = False, symm_mem: bool = False) -> str | None:
    """The overlap method `--tp-overlap` resolves to on a machine of `device_type` (`symm_mem`: its
    torch has the fused symmetric-memory matmuls, `symm_mem_available`), or None for the unfused
    collectives.

    `auto` keeps the separate collectives on CUDA, where the fused symmetric-memory ops measured
    slower than them on two H200s (llama-1b and llama-8b at tp=2 with sequence parallelism; the
    README's tables), and overlaps in chunks elsewhere; none under `--async-tp`, which asks
    inductor to find the same fusion itself."""
    if choice not in OVERLAP_CHOICES:
        raise UserError(f"unknown --tp-overlap {choice!r}; choose one of {', '.join(OVERLAP_CHOICES)}")
    active = sequence_parallel and tp > 1
    if choice in OVERLAP_METHODS and not active:
        raise UserError(f"--tp-overlap {choice} fuses the collectives of sequence parallelism; give "
                        f"--sequence-parallel and a mesh with tp > 1, or drop --tp-overlap")
    if choice in OVERLAP_METHODS and async_tp:
        raise UserError(f"--tp-overlap {choice} and --async-tp are two ways to the same overlap; give one")
    if choice == "symm_mem" and device_type != "cuda":
        raise UserError("--tp-overlap symm_mem needs CUDA GPUs (torch's symmetric memory); use "
                        "--tp-overlap chunked")
    if choice == "symm_mem" and not symm_mem:
        raise UserError("--tp-overlap symm_mem: this torch build has no fused symmetric-memory matmuls; use "
                        "--tp-overlap chunked or none")
    if choice == "none" or not active or (choice == "auto" and async_tp):
        return None
    if choice == "auto":
        return None if device_type == "cuda" else "chunked"
    return choice


def unfused_matmuls(plan, *, fp8: bool, fp8_head: bool) -> list[str]:
    """Which matmuls of an overlapping plan keep separate collectives, and why (for the log)."""
    reasons = []
    if fp8:
        reasons.append("the FP8 blocks' (torchao casts inside its own matmul and backward)")
    if fp8_head:
        reasons.append("the FP8 output head's")
    if plan.param_rules.get("kv_heads") is None:
        reasons.append("q/k/v's (the KV projections are whole on every tp rank; one gather still serves all three)")
    return reasons


def enable_symmetric_memory(group: TpGroup) -> None:
    """Registers the tp group with symmetric memory. torch 2.11 deprecates the call as unneeded,
    yet its `is_symm_mem_enabled_for_group` (read by inductor's async-TP pass) stays False without
    it (pytorch/pytorch#193027); it is idempotent, so it is made anyway, where it still exists."""
    from torch.distributed import _symmetric_memory

    enable_symm_mem_for_group = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable_symm_mem_for_group is None:  # removed: torch resolves the group by name itself
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group.name)


def chunk_bounds(length: int, num_chunks: int) -> list[tuple[int, int]]:
    """[start, stop) of up to `num_chunks` non-empty pieces of `length` (sizes as torch.chunk)."""
    size = -(-length // num_chunks)
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """[batch, seq, features] -> [tokens, features] in sequence-major order (free for gathered
    tensors, which are stored that way)."""
    return t.movedim(SEQ_DIM, 0).reshape(-1, t.shape[-1])


def _batch_major(rows: torch.Tensor) -> torch.Tensor:
    """[seq, batch, features] storage as a [batch, seq, features] view."""
    return rows.movedim(0, SEQ_DIM)


def _seq_major(t: torch.Tensor) -> torch.Tensor:
    """`t` restrided so that its sequence-major view is contiguous, as torch's fused ops want
    their input (their `restride_*` helpers do the same); a copy only when it is not already."""
    return _batch_major(t.movedim(SEQ_DIM, 0).contiguous())


def _overlaps(t: torch.Tensor) -> bool:
    """Whether a chunk's collective stays in flight while the next chunk's matmuls run. On NCCL it
    runs beside them on its own stream. On gloo it runs on the process group's worker threads,
    which share the CPU with the matmuls, so there is nothing to win, and runs that left several
    functional collectives in flight at once died now and then on SIGSEGV: there each
    collective is waited on as soon as it is issued."""
    return t.is_cuda


def _issued(pending: torch.Tensor, overlap: bool) -> torch.Tensor:
    """A collective's result, left in flight where collectives overlap, else waited on at once
    (waiting again later is a no-op)."""
    return pending if overlap else _c10d.wait_tensor(pending)


def _chunked_all_gather_matmul(a_shard: torch.Tensor, bs: list[torch.Tensor], group: TpGroup):
    rows = a_shard.movedim(SEQ_DIM, 0).contiguous()  # [s, batch, k]: this rank's tokens
    n, rank, s = group.size, group.rank, rows.shape[0]
    a_full = rows.new_empty(n, *rows.shape)  # [rank, s, batch, k]
    outs = [rows.new_empty(n, *rows.shape[:-1], b.shape[1]) for b in bs]
    bounds, overlap = chunk_bounds(s, n), _overlaps(rows)

    def gather(chunk: int) -> torch.Tensor:
        start, stop = bounds[chunk]
        return _issued(_c10d.all_gather_into_tensor(rows[start:stop], n, group.name), overlap)

    pending = gather(0)
    for out, b in zip(outs, bs):
        out[rank] = rows @ b  # the tokens this rank holds need no communication
    for chunk, (start, stop) in enumerate(bounds):
        gathered = _c10d.wait_tensor(pending).view(n, stop - start, *rows.shape[1:])
        if chunk + 1 < len(bounds):
            pending = gather(chunk + 1)  # in flight while this chunk's matmuls run (one at a time)
        a_full[:, start:stop] = gathered
        for out, b in zip(outs, bs):
            for first, last in ((0, rank), (rank + 1, n)):
                if last > first:
                    out[first:last, start:stop] = gathered[first:last] @ b
    return (_batch_major(a_full.view(n * s, *rows.shape[1:])),
            [_batch_major(out.view(n * s, *out.shape[2:])) for out in outs])


def _chunked_matmul_reduce_scatter(pairs: list[tuple[torch.Tensor, torch.Tensor]], group: TpGroup):
    n = group.size
    seq_major = [a.movedim(SEQ_DIM, 0) for a, _ in pairs]  # [seq, batch, k]
    s = seq_major[0].shape[0] // n
    by_rank = [a.view(n, s, *a.shape[1:]) if a.is_contiguous() else a.reshape(n, s, *a.shape[1:])
               for a in seq_major]
    bounds, overlap = chunk_bounds(s, n), _overlaps(seq_major[0])
    # Contiguous [batch, s, n], as torch's fused op returns it: the residual stream it joins is
    # sent between pipeline stages, whose receive buffers must be contiguous.
    out = pairs[0][0].new_empty(seq_major[0].shape[1], s, pairs[0][1].shape[1])

    def land(chunk: int, pending: torch.Tensor) -> None:
        start, stop = bounds[chunk]
        out[:, start:stop] = _batch_major(_c10d.wait_tensor(pending).squeeze(0))

    in_flight = None
    for chunk, (start, stop) in enumerate(bounds):
        # Each rank's chunk of the partial sums, ranks outermost: the reduce-scatter's layout.
        partial = None
        for a, (_, b) in zip(by_rank, pairs):
            term = a[:, start:stop] @ b
            partial = term if partial is None else partial.add_(term)
        if in_flight is not None:
            land(*in_flight)  # the previous chunk's reduce-scatter ran beside this chunk's matmuls
        in_flight = (chunk, _issued(_c10d.reduce_scatter_tensor(partial, "sum", n, group.name), overlap))
    land(*in_flight)
    return out


def all_gather_matmul(a_shard: torch.Tensor, bs: list[torch.Tensor], group: TpGroup, method: str):
    """(all_gather(a_shard over seq), [that @ b for b in bs]); a_shard [batch, s, k], b [k, n_i]."""
    if method == "symm_mem":
        a_full, outs = torch.ops.symm_mem.fused_all_gather_matmul(_seq_major(a_shard), bs, SEQ_DIM, group.name,
                                                                  return_A=True)
        return a_full, list(outs)
    return _chunked_all_gather_matmul(a_shard, bs, group)


def matmul_reduce_scatter(pairs: list[tuple[torch.Tensor, torch.Tensor]], group: TpGroup, method: str):
    """reduce_scatter(sum of a @ b over `pairs`, over seq): a [batch, seq, k_i], b [k_i, n]."""
    if method == "symm_mem":
        a = pairs[0][0] if len(pairs) == 1 else torch.cat([a for a, _ in pairs], dim=-1)
        b = pairs[0][1] if len(pairs) == 1 else torch.cat([b for _, b in pairs], dim=0)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(_seq_major(a), b, "sum", SEQ_DIM, group.name)
    return _chunked_matmul_reduce_scatter(pairs, group)


class AllGatherLinear(torch.autograd.Function):
    """[x_shard @ w.T for w in weights] with x gathered over the sequence inside the matmul: the
    column-parallel projections of sequence-sharded input (q/k/v share one gather, gate/up one)."""

    @staticmethod
    def forward(ctx, x_shard: torch.Tensor, group: TpGroup, method: str, *weights: torch.Tensor):
        x_full, outs = all_gather_matmul(x_shard, [w.t() for w in weights], group, method)
        ctx.save_for_backward(x_full, *weights)
        ctx.group, ctx.method = group, method
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x_full, *weights = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            # The gradients of all outputs summed before the reduce-scatter: one collective.
            grad_x = matmul_reduce_scatter(list(zip(grads, weights)), ctx.group, ctx.method)
        x_tokens = _tokens(x_full)
        grad_weights = [_tokens(g).t() @ x_tokens if needed else None
                        for g, needed in zip(grads, ctx.needs_input_grad[3:])]
        return grad_x, None, None, *grad_weights


class LinearReduceScatter(torch.autograd.Function):
    """x @ weight.T reduce-scattered over the sequence as it is produced: the row-parallel
    projections (wo, w_down) of feature-sharded input, whose output is the sequence shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TpGroup, method: str, weight: torch.Tensor):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.method = group, method
        return matmul_reduce_scatter([(x, weight.t())], group, method)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_full, (grad_x,) = all_gather_matmul(grad, [weight], ctx.group, ctx.method)
        grad_weight = _tokens(grad_full).t() @ _tokens(x) if ctx.needs_input_grad[3] else None
        return (grad_x if ctx.needs_input_grad[0] else None), None, None, grad_weight


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """[tokens, vocab shard] in fp32, or the logits' own dtype where that is wider."""
    return logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))


class VocabParallelCrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of logits split over tp along the vocabulary, without full logits on
    any rank (Megatron's vocab-parallel loss): the max and the sum of exponentials and the label's
    logit are reduced over tp (two all-reduces of one number per token), and the gradient,
    softmax minus one-hot, is each rank's own slice. Explicit collectives rather than DTensor's
    `loss_parallel`, so that the compiled head fuses it into a few passes over the logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: TpGroup):
        x = _at_least_fp32(logits)
        labels = labels.reshape(-1)
        row_max = _c10d.wait_tensor(_c10d.all_reduce(x.amax(dim=-1), "max", group.name))
        shifted = x - row_max.unsqueeze(-1)
        local = labels - vocab_start
        here = (local >= 0) & (local < x.shape[-1])
        label_logit = shifted.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * here
        sums = _c10d.wait_tensor(_c10d.all_reduce(torch.stack([shifted.exp().sum(-1), label_logit]), "sum",
                                                  group.name))
        log_sum_exp = sums[0].log()
        counted = labels != -100
        ctx.save_for_backward(logits, row_max + log_sum_exp, local, here & counted, counted)
        return ((log_sum_exp - sums[1]) * counted).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, log_normalizer, local, label_here, counted = ctx.saved_tensors
        x = _at_least_fp32(logits)
        softmax = (x - log_normalizer.unsqueeze(-1)).exp() * counted.unsqueeze(-1)
        one_hot = torch.zeros_like(softmax).scatter_(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1),
                                                    label_here.unsqueeze(-1).to(softmax.dtype))
        return ((softmax - one_hot) * grad).to(logits.dtype).view_as(logits), None, None, None


def _combine_over_vocab_shards(log_sum_exp: torch.Tensor, label_logit: torch.Tensor, group: TpGroup):
    """Each rank's (log-sum-exp, label logit) of its vocabulary slice -> those of the whole
    vocabulary, from one all-gather of both: the log-sum-exp of the ranks' log-sum-exps, and the
    label's logit from the one rank that holds it (zero elsewhere)."""
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
        torch.stack([log_sum_exp, label_logit]), group.size, group.name)).view(group.size, 2, -1)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(0)


def vocab_parallel_linear_cross_entropy_sum(h: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                            chunk_tokens: int, vocab_start: int, group: TpGroup,
                                            compile: bool = False) -> torch.Tensor:
    """The chunked output projection and loss (models/linear_cross_entropy.py) on this rank's
    vocabulary slice of the weight (rows vocab_start, vocab_start + 1, ...), with the whole input:
    per chunk, one all-gather of two numbers per token merges the ranks' statistics, and each
    rank's gradients are its slice's terms (that of the input a partial sum over tp, which the
    caller's layout reduces)."""
    return linear_cross_entropy_sum(h, weight_shard, labels, chunk_tokens, compile, vocab_start=vocab_start,
                                    combine=_combine_over_vocab_shards, group=group)
