"""Expert parallelism: `ModelContext.experts` (and `experts_on_tokens`) over a process group whose
ranks each hold a block of experts.

Each of the `ep` ranks holds experts `rank * E/ep .. (rank + 1) * E/ep - 1` and its own tokens,
already sorted by expert (models/moe.py). The rows of each expert travel to the rank that holds
it in one all-to-all of uneven splits, run through the local experts as one grouped GEMM, and come
back with the reverse all-to-all:

    counts all-to-all (the one host sync: split sizes must be Python ints)
    -> rows all-to-all -> regroup by local expert -> grouped SwiGLU -> undo regroup -> rows back

Under --compile the exchange runs outside the block's graph: its split sizes are new Python ints
every step, which a graph would guard on, and traced through it the block fell into many small
graphs, each compiled again at step 2 (FSDP's gathered expert weights change requires_grad after
the first step) and again when its sizes went dynamic. The grouped SwiGLU inside it is compiled
on its own, with dynamic row counts from the start.

`--ep-dispatch allgather` exchanges whole tokens without a host sync and with static shapes, so
everything between its collectives compiles into one graph of its own (Megatron's all-gather
token dispatcher, for small ep). It is `ModelContext.experts_on_tokens`: it gets the routed
tokens, not sorted rows.

    all-gather every rank's tokens, expert choices and routing weights
    -> the slots of this rank's experts first, grouped by expert -> grouped SwiGLU over them (the
       other slots masked to zero) -> weighted and summed per token, as `models.moe.combine` does
    -> reduce-scatter: each rank sums, for its own tokens, the partial sums every rank made

Each way, a rank moves ep - 1 rows per token it holds, where the balanced all-to-all moves
top_k (ep - 1) / ep: ep / top_k times the all-to-all's bytes (the same at ep=2 with top-2), and
no more when routing is uneven. Every rank must hold the same number of tokens.

The collectives (parallel/collectives.py) have finished when they return, one at a time: gloo
runs them on worker threads, and runs that left several in flight at once crashed now and then
(SIGSEGV; tests/integration/test_collective_stress.py repeats them).

Backward is plain autograd through the differentiable collectives and the permutations, so a
local expert's weight gradient sums the contributions of every rank's tokens routed to it: the
expert gradients are reduced over exactly the ranks that send tokens to those experts, with no
extra collective. A data-parallel reduction over the ranks that hold the *same* experts (other
ep groups) is still the data-parallel layer's job.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from models.context import ExpertBiases, grouped_swiglu
from models.errors import UserError
from models.moe import combine
from parallel import collectives


def _check_shapes(x, counts, weights, num_experts: int, ep: int) -> int:
    """Experts per rank. The sizes agree by construction (the layout checked the experts over ep,
    and the plan shards their dim over the ep group): a disagreement is a bug, not a user's input."""
    assert num_experts % ep == 0, (num_experts, ep)
    local_experts = num_experts // ep
    assert counts is None or counts.shape == (num_experts,), (tuple(counts.shape), num_experts)
    assert all(weight.shape[0] == local_experts for weight in weights), ([w.shape for w in weights], local_experts)
    assert x.dim() == 2, tuple(x.shape)
    return local_experts


def _expert_major_positions(received_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Where each received row goes when rows are regrouped by local expert.

    Rows arrive in blocks ordered (source rank, local expert) with sizes `received_counts`
    [ep, local_experts]; the grouped GEMM wants them ordered (local expert, source rank). Computed
    from the counts on the device, without a sort and without another host sync.
    """
    ep, local_experts = received_counts.shape
    device = received_counts.device
    sizes = received_counts.flatten()
    block_of_row = torch.repeat_interleave(torch.arange(ep * local_experts, device=device), sizes, output_size=total)
    source_start = torch.cumsum(sizes, 0) - sizes
    by_expert = received_counts.t().flatten()  # the same blocks, expert-major
    expert_major_start = (torch.cumsum(by_expert, 0) - by_expert).view(local_experts, ep).t().flatten()
    offset_in_block = torch.arange(total, device=device) - source_start[block_of_row]
    return expert_major_start[block_of_row] + offset_in_block


def _host_split_sizes(send_and_receive: torch.Tensor, rows: int) -> list[list[int]]:
    """[rows sent to each rank, rows received from each]: the block's one host read. Fake tensors
    (a dry run) hold no counts: there, the sizes of balanced routing."""
    if is_fake(send_and_receive):
        ep = send_and_receive.shape[1]
        even = [rows // ep + (rank < rows % ep) for rank in range(ep)]
        return [even, even]
    return send_and_receive.tolist()


def expert_parallel_swiglu(x: torch.Tensor, counts: torch.Tensor, w_gate_local: torch.Tensor,
                           w_up_local: torch.Tensor, w_down_local: torch.Tensor, *,
                           group: dist.ProcessGroup, num_experts: int, swiglu=grouped_swiglu,
                           biases: ExpertBiases | None = None, glu=None) -> torch.Tensor:
    """`LocalContext.experts` over `group`: x [rows, embed] sorted by expert with `counts` [num_experts]
    rows each (this rank's tokens, all experts); w_*_local the [num_experts / ep, ...] weights of this
    rank's block of experts (and `biases` theirs, applied here, on the experts' rank). Returns
    [rows, embed], each row its expert's output, in x's order. `swiglu` computes the local experts
    (`grouped_swiglu`, or a compiled version of it)."""
    ep = dist.get_world_size(group)
    _check_shapes(x, counts, (w_gate_local, w_up_local, w_down_local, *(biases or ())), num_experts, ep)
    local_experts = num_experts // ep
    counts = counts.to(torch.int64)

    # Rank r's counts for its experts block j go to rank j; rank j then holds, as row r of
    # received_counts, how many rows rank r sends for each of j's experts.
    received_counts = collectives.all_to_all(counts, None, None, group).view(ep, local_experts)
    send_and_receive = torch.stack([counts.view(ep, local_experts).sum(1), received_counts.sum(1)])
    send_splits, receive_splits = _host_split_sizes(send_and_receive, x.shape[0])
    total_received = sum(receive_splits)
    # Rows past the counted ones (slots over capacity) stay here, and come back zero.
    surplus = x.shape[0] - sum(send_splits)

    received = collectives.all_to_all(x[:sum(send_splits)], receive_splits, send_splits, group)

    destination = _expert_major_positions(received_counts, total_received)
    gather_order = torch.empty_like(destination).scatter_(
        0, destination, torch.arange(total_received, device=destination.device)
    )
    out_by_expert = swiglu(received[gather_order], received_counts.sum(0), w_gate_local, w_up_local,
                           w_down_local, **_variant(biases, glu))
    out_received = out_by_expert[destination]

    out = collectives.all_to_all(out_received, send_splits, receive_splits, group)
    return torch.cat([out, out.new_zeros(surplus, out.shape[1])]) if surplus else out


def _local_slot_order(all_expert_ids: torch.Tensor, rank: int, local_experts: int):
    """For the gathered tokens' top-k slots (`all_expert_ids` [tokens, k]; slot t * k + j is token
    t's j-th choice): the permutation that puts the slots of this rank's experts first, grouped by
    local expert; the slots per local expert; and which positions of the permuted slots are theirs."""
    local_expert = all_expert_ids.flatten() - rank * local_experts
    is_local = (local_expert >= 0) & (local_expert < local_experts)
    key = torch.where(is_local, local_expert, local_experts)
    order = torch.argsort(key, stable=True)
    # A scatter-add rather than bincount, whose output size depends on the data.
    per_key = torch.zeros(local_experts + 1, dtype=torch.long, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))
    local_counts = per_key[:local_experts]
    valid = torch.arange(key.numel(), device=key.device) < local_counts.sum()
    return order, local_counts, valid


def _gathered_slots_through_local_experts(all_x: torch.Tensor, all_ids: torch.Tensor, all_weights: torch.Tensor,
                                          w_gate_local: torch.Tensor, w_up_local: torch.Tensor,
                                          w_down_local: torch.Tensor, *, rank: int, local_experts: int,
                                          swiglu, biases: ExpertBiases | None = None, glu=None) -> torch.Tensor:
    """The all-gather dispatch between its collectives, on the gathered tokens of every rank
    (`all_x` [tokens, embed], `all_ids` and `all_weights` [tokens, top_k]): [tokens, embed], each
    token's weighted sum over those of its slots that chose this rank's experts. Static shapes."""
    top_k = all_ids.shape[1]
    order, local_counts, valid = _local_slot_order(all_ids, rank, local_experts)
    valid = valid[:, None]
    # The slots past this rank's experts' are zeroed on the way in and out, so that neither their
    # values nor their gradients depend on what the kernel leaves there.
    hidden = torch.where(valid, all_x[order // top_k], 0)
    out_sorted = torch.where(valid, swiglu(hidden, local_counts, w_gate_local, w_up_local, w_down_local,
                                           **_variant(biases, glu)), 0)
    return combine(out_sorted, all_weights, order)


def expert_parallel_tokens_allgather(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                                     w_gate_local: torch.Tensor, w_up_local: torch.Tensor,
                                     w_down_local: torch.Tensor, *, group: dist.ProcessGroup, num_experts: int,
                                     swiglu=grouped_swiglu,
                                     through_local_experts=_gathered_slots_through_local_experts,
                                     biases: ExpertBiases | None = None, glu=None) -> torch.Tensor:
    """`ModelContext.experts_on_tokens` by all-gather and reduce-scatter (the module docstring):
    x [tokens, embed], expert_ids and weights [tokens, top_k] this rank's routed tokens; every rank
    of `group` must hold the same number of tokens. Returns [tokens, embed]: each token's weighted
    sum of its top-k experts' outputs. `through_local_experts` is the step between the collectives
    (`_gathered_slots_through_local_experts`, or a compiled version of it)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    local_experts = _check_shapes(x, None, (w_gate_local, w_up_local, w_down_local, *(biases or ())), num_experts,
                                  ep)
    all_x = collectives.all_gather(x, group)
    all_ids = collectives.all_gather(expert_ids, group)
    all_weights = collectives.all_gather(weights, group)
    partial = through_local_experts(all_x, all_ids, all_weights, w_gate_local, w_up_local, w_down_local,
                                    rank=rank, local_experts=local_experts, swiglu=swiglu, **_variant(biases, glu))
    return collectives.reduce_scatter(partial, group)


def _local(t: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's part of a possibly-DTensor input: whole rows (dim 0 split or not), never a slice
    of the embed or mlp dims, which would need a reduction that dispatch does not do."""
    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names or tuple(map(str, range(t.device_mesh.ndim)))
    for mesh_dim, placement in zip(names, t.placements):
        if not (placement.is_replicate() or placement.is_shard(0)):
            raise UserError(
                f"expert-parallel dispatch got {name} laid out as {placement} over mesh dim {mesh_dim!r}; "
                f"it needs whole experts and whole rows: keep the expert weights' mlp and embed dims "
                f"unsplit in the plan (split only the expert dim, over ep)"
            )
    # A weight sharded on dim 0 over the ep dim: its local shard is this rank's block of experts,
    # and the local gradient (summed over all senders by the all-to-all backward) is the shard's
    # gradient, so the default grad placements are right.
    return t.to_local()


EP_DISPATCHES = ("auto", "alltoall", "allgather")


def choose_dispatch(choice: str, ep: int, top_k: int, dropless: bool) -> str:
    """--ep-dispatch: `auto` takes the all-gather where it moves no more bytes than the all-to-all
    (ep <= top_k) and routing is dropless, which it needs; else the all-to-all."""
    if choice not in EP_DISPATCHES:
        raise UserError(f"unknown --ep-dispatch {choice!r}; choose one of {', '.join(EP_DISPATCHES)}")
    if choice != "auto":
        return choice
    return "allgather" if dropless and ep <= top_k else "alltoall"


def max_ranks_per_token(num_experts: int, ep: int, top_k: int, num_groups: int = 1, topk_groups: int = 1) -> int:
    """The most ep ranks one token's experts can be on. Rank r holds experts r * E/ep ..; group g is
    experts g * E/G ..; with group-limited routing a token's experts lie in topk_groups groups, so
    the ranks those groups span bound it (DeepSeek-V3's node-limited routing: with groups of whole
    ranks' experts, topk_groups ranks)."""
    per_rank, per_group = num_experts // ep, num_experts // num_groups
    bound = ep
    if num_groups > 1:
        spans = sorted((len({e // per_rank for e in range(g * per_group, (g + 1) * per_group)})
                        for g in range(num_groups)), reverse=True)
        bound = sum(spans[:topk_groups])
    return min(bound, top_k, ep)


def ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


@functools.cache
def _compiled(fn, **options):
    """`torch.compile(fn, **options)`, made on first use: making it imports the compiler, which
    costs every process seconds at start, compiling or not."""
    return torch.compile(fn, **options)


def _variant(biases: ExpertBiases | None, glu) -> dict:
    """The experts op's keywords for an expert variant (none for plain SwiGLU experts, so that an
    experts function that takes no variants is called as before)."""
    return {name: value for name, value in (("biases", biases), ("glu", glu)) if value is not None}


def _on_local_tensors(exchange, x, inputs: dict[str, torch.Tensor], biases: ExpertBiases | None = None,
                      **kwargs) -> torch.Tensor:
    """`exchange(x, *inputs.values())` on this rank's tensors (the weights and `biases`: its block of
    experts, plain or DTensors sharded on dim 0 over the ep mesh dim; a DTensor `x`, activations
    laid out over tp/cp, and what was computed from it: its local rows, this rank's tokens), the
    output re-wrapped with x's layout."""
    layout = (x.device_mesh, x.placements) if isinstance(x, DTensor) else None
    if biases is not None:
        kwargs["biases"] = ExpertBiases(*(_local(t, f"b_{name}") for name, t in zip(biases._fields, biases)))
    out = exchange(_local(x, "x"), *(_local(t, name) for name, t in inputs.items()), **kwargs)
    return out if layout is None else DTensor.from_local(out, *layout, run_check=False)


def _local_swiglu(compile_experts: bool, fp8_experts, group: dist.ProcessGroup | None, num_experts: int, **options):
    """What computes this rank's experts: FP8 experts told the global id of the rank's first expert,
    else the bf16 grouped GEMM, compiled with `options` where `compile_experts`."""
    if fp8_experts is not None:
        # Not compiled on their own: dynamo fails on the FP8 experts' autograd functions with
        # dynamic row counts (in a block's graph or the all-gather's step, shapes are static).
        rank = dist.get_rank(group) if ep_size(group) > 1 else 0
        return functools.partial(fp8_experts, first=rank * (num_experts // ep_size(group)))
    return _compiled(grouped_swiglu, **options) if compile_experts else grouped_swiglu


@torch.compiler.disable
def experts_over_group(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, *, group: dist.ProcessGroup | None,
                       compile_experts: bool = False, fp8_experts=None, biases: ExpertBiases | None = None,
                       glu=None) -> torch.Tensor:
    """`ModelContext.experts` for a context that may have expert parallelism, outside compiled
    graphs (the module docstring says why); `compile_experts` compiles the local experts' SwiGLU.
    With no group or ep == 1 this is the single-device path unchanged; the global expert count is
    `counts.numel()`. `fp8_experts` runs the local experts in FP8 instead."""
    # Row counts differ every step: dynamic from the first compile.
    swiglu = _local_swiglu(compile_experts, fp8_experts, group, counts.shape[0], dynamic=True)
    if ep_size(group) == 1:
        return swiglu(x, counts, w_gate, w_up, w_down, **_variant(biases, glu))
    inputs = {"counts": counts, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    return _on_local_tensors(expert_parallel_swiglu, x, inputs, biases, group=group, swiglu=swiglu,
                             num_experts=counts.shape[0], **_variant(None, glu))


@torch.compiler.disable
def experts_on_tokens_by_allgather(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                                   w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                                   group: dist.ProcessGroup, compile_experts: bool = False,
                                   fp8_experts=None, biases: ExpertBiases | None = None, glu=None) -> torch.Tensor:
    """`expert_parallel_tokens_allgather` on possibly-DTensor inputs. The local tensors are taken
    outside compiled graphs: traced inside the block, FSDP's gathered expert weights (DTensors)
    change requires_grad after the first step and the block compiles again. `compile_experts`
    compiles the step between the collectives on its own, once (its shapes are static)."""
    local_step = _compiled(_gathered_slots_through_local_experts) if compile_experts else \
        _gathered_slots_through_local_experts
    # A DTensor weight has the global expert count as its shape; a plain one is this rank's block.
    num_experts = w_gate.shape[0] if isinstance(w_gate, DTensor) else w_gate.shape[0] * ep_size(group)
    inputs = {"expert_ids": expert_ids, "weights": weights, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    return _on_local_tensors(expert_parallel_tokens_allgather, x, inputs, biases, group=group, num_experts=num_experts,
                             through_local_experts=local_step,
                             swiglu=_local_swiglu(False, fp8_experts, group, num_experts), **_variant(None, glu))


class ExpertParallelContextMixin:
    """Gives a model context the expert-parallel `experts` (the all-to-all) and, with
    `ep_dispatch` "allgather", `experts_on_tokens`. Put it before `LocalContext` in the bases and
    set `ep_group` (None or a group of one rank keeps the single-device path), `ep_dispatch`
    ("alltoall" or "allgather"), and `compile_experts` when the blocks are compiled."""

    ep_group: dist.ProcessGroup | None = None
    ep_dispatch: str = "alltoall"
    compile_experts: bool = False
    fp8_linear = None
    # torchao's FP8 grouped GEMMs (parallel.fp8_experts.Fp8GroupedExperts) where the layer's
    # experts run them (--fp8-experts with the torchao backend).
    fp8_grouped_experts = None

    @property
    def fp8_experts(self):
        """The layer's FP8 experts, called as the experts op on local tensors (plus `first`, the
        global id of the rank's first expert): Transformer Engine's (`parallel.te_experts.
        LayerExperts`) or torchao's grouped GEMMs; None where they are bf16."""
        return getattr(self.fp8_linear, "experts", None) or self.fp8_grouped_experts

    def _check_fp8_takes(self, variant: dict) -> None:
        if getattr(self.fp8_linear, "experts", None) is not None and variant:
            raise UserError("Transformer Engine's FP8 experts run plain SwiGLU without biases; these experts have "
                            "biases or gpt-oss's clamped unit: drop --fp8-experts")

    def experts_on_tokens(self, x, expert_ids, weights, w_gate, w_up, w_down, *, biases=None, glu=None):
        variant = _variant(biases, glu)
        self._check_fp8_takes(variant)
        if ep_size(self.ep_group) == 1 or self.ep_dispatch != "allgather":
            return super().experts_on_tokens(x, expert_ids, weights, w_gate, w_up, w_down, **variant)
        return experts_on_tokens_by_allgather(x, expert_ids, weights, w_gate, w_up, w_down, group=self.ep_group,
                                              compile_experts=self.compile_experts, fp8_experts=self.fp8_experts,
                                              **variant)

    def experts(self, x, counts, w_gate, w_up, w_down, *, biases=None, glu=None):
        variant = _variant(biases, glu)
        self._check_fp8_takes(variant)
        if ep_size(self.ep_group) == 1 and self.fp8_experts is not None:
            # In the block's graph, on the local tensors.
            inputs = {"counts": counts, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
            return _on_local_tensors(self.fp8_experts, x, inputs, biases, **_variant(None, glu))
        if ep_size(self.ep_group) == 1:
            return super().experts(x, counts, w_gate, w_up, w_down, **variant)
        return experts_over_group(x, counts, w_gate, w_up, w_down, group=self.ep_group,
                                  compile_experts=self.compile_experts, fp8_experts=self.fp8_experts, **variant)
