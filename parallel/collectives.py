"""Differentiable collectives that have finished when they return: expert parallelism's exchange.

    out = all_gather(x, group)                      # every rank's rows, rank order; backward: reduce-scatter
    out = reduce_scatter(x, group)                  # sum over ranks, this rank's rows; backward: all-gather
    out = all_to_all(x, out_splits, in_splits, group)  # uneven splits; backward: the reverse all-to-all

torch's functional collectives return at once and wait on first use of their result. On gloo the
communication runs on the process group's own worker threads, which copy into and out of the
caller's tensors and hold (and finally drop) references to them. The all-gather dispatch used to
leave three of them in flight (tokens, expert ids, routing weights) while this thread went on
allocating and freeing; expert-parallel runs on gloo died now and then on SIGSEGV or "malloc():
unaligned tcache chunk detected", and a loop of functional all-gathers left in flight
so crashed where the same loop waiting on each did not. Here each collective waits for its
communication before returning: one collective at a time, none in flight while we compute.

The ops are the functional collectives' own (`torch.ops._c10d_functional`), each followed at once
by its `wait_tensor`: selective recompute keeps their outputs (parallel/recompute.py), and on NCCL
the wait only makes the current stream wait for the communication, with no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ops = torch.ops._c10d_functional


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_gather_into_tensor(x.contiguous(), dist.get_world_size(group), group.group_name))


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    ranks = dist.get_world_size(group)
    assert x.shape[0] % ranks == 0, f"reduce-scatter of {x.shape[0]} rows over {ranks} ranks"
    return _ops.wait_tensor(_ops.reduce_scatter_tensor(x.contiguous(), "sum", ranks, group.group_name))


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[ranks * rows, ...]: every rank's x along dim 0, in rank order. Every rank's x has the same shape."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[rows / ranks, ...]: this rank's block of the sum over ranks of x (rows divisible by ranks)."""
    return _ReduceScatter.apply(x, group)


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
               group: dist.ProcessGroup) -> torch.Tensor:
    """Rows `in_splits[r]` of x go to rank r; this rank receives `out_splits[r]` rows from rank r,
    in rank order. With both None, x splits evenly over the ranks."""
    if out_splits is None and in_splits is None:
        ranks = dist.get_world_size(group)
        out_splits = in_splits = [x.shape[0] // ranks] * ranks
    return _AllToAll.apply(x, out_splits, in_splits, group)
