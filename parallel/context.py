"""The parallel meaning of the model context: DTensor layouts from the plan, kernel choice per device."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.context import LocalContext
from models.linear_cross_entropy import linear_cross_entropy_sum
from models.masking import AttentionMask
from parallel import masked_attention
from parallel.attention_sinks import attention_with_sinks
from parallel.fused_attention import fused_causal_attention
from parallel.context_parallel import WHOLE_ROW, context_parallel_attention, mask_sites
from parallel.expert_parallel import ExpertParallelContextMixin
from parallel.layout import ParallelLayout
from parallel.mesh import Meshes
from parallel.tensor_parallel import (SEQ_DIM, AllGatherLinear, LinearReduceScatter, TpGroup,
                                      VocabParallelCrossEntropySum, vocab_parallel_linear_cross_entropy_sum)

# cuDNN attention is the fastest on Hopper (measured on H200s, forward and backward), flash next.
# The memory-efficient kernel is left out: it is slow and gives wrong gradients under load-balanced
# context parallelism.
CUDA_ATTENTION_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def shard_extent(x: DTensor, dim: int) -> tuple[int, int]:
    """The length and global offset of this rank's part of `x` along `dim` (Shard placements,
    split left to right as torch.chunk does). Plain arithmetic: torch's own helper indexes tensors,
    which a fake-tensor dry run cannot read."""
    length, offset = x.shape[dim], 0
    for mesh_dim, placement in enumerate(x.placements):
        if placement.is_shard(dim):
            chunk = -(-length // x.device_mesh.size(mesh_dim))
            start = min(chunk * x.device_mesh.get_local_rank(mesh_dim), length)
            length, offset = min(chunk, length - start), offset + start
    return length, offset


class ParallelContext(ExpertParallelContextMixin, LocalContext):
    """Constrains activations to the plan's layout; runs local kernels on the local shards;
    sends tokens to the ranks holding their experts when ep > 1. Everything it does is decided
    by `layout` (parallel/layout.py); it holds the groups of `meshes` that its layers talk over.
    `device`: where the layers compute (default: the mesh's device type)."""

    def __init__(self, layout: ParallelLayout, meshes: Meshes, *, device: torch.device | None = None):
        plan = layout.plan
        mesh, spec = meshes.world, plan.mesh_spec
        self.layout, self.plan = layout, plan
        self.device = device if device is not None else torch.device(mesh.device_type)
        self.compute_dtype = layout.compute_dtype
        self.fuse_projections = layout.fuse_projections
        self.loss_chunk_tokens = layout.loss_chunk_tokens
        self.compile_loss_chunks = self.compile_experts = layout.compile
        dims = plan.activation_mesh_dims
        self.activation_mesh = mesh[dims] if dims else None
        self.cp_group = meshes.group("cp") if spec.cp > 1 else None
        self.cp_method = layout.cp_comm
        self.ep_group = meshes.group("ep") if meshes.experts is not None else None
        self.ep_dispatch = layout.ep_dispatch or "alltoall"
        self.fp8_linear = None
        tp = mesh.get_group("tp") if "tp" in dims else None
        self.tp_group = TpGroup(tp.group_name, tp.size(), tp.rank()) if tp is not None else None
        # How sequence-parallel matmuls gather and scatter (parallel/tensor_parallel.py): "symm_mem",
        # "chunked", or None for DTensor's separate collectives (and wherever the plan does not overlap).
        self.tp_overlap: str | None = layout.tp_overlap if plan.overlaps_tp else None
        # Ranks holding other tokens of the same samples: cp always, tp inside `per_token`.
        self.token_shard_groups = meshes.groups(spec.token_shard_dims)

    def with_fp8(self, fp8_linear, grouped_experts=None) -> ParallelContext:
        """The same context with its matmuls in FP8 (given to the blocks that use it), and its
        routed experts in torchao's FP8 grouped GEMMs where `grouped_experts` is given."""
        ctx = copy.copy(self)
        ctx.fp8_linear = fp8_linear
        ctx.fp8_grouped_experts = grouped_experts
        return ctx

    def linear(self, x, weight):
        overlapped = self._overlapped_linear(x, [weight])
        if overlapped is not None:
            return overlapped[0]
        x = self._gathered(x)
        if self.fp8_linear is None:
            return F.linear(x, weight)
        if getattr(self.fp8_linear, "on_local_shards", False) and isinstance(weight, DTensor):
            return self._linear_on_local_shards(x, weight)
        return self.fp8_linear(x, weight)

    def _linear_on_local_shards(self, x: DTensor, weight: DTensor) -> DTensor:
        """`fp8_linear` on this rank's shards, laid out as the plan says: a weight split over its
        output features (column) takes the whole input and gives output shards; one split over
        its input features (row) takes input shards and gives partial sums, which the next
        `constrain` reduces (an all-reduce, or a reduce-scatter under sequence parallelism); a
        whole weight takes and gives whole tensors. Other input layouts are redistributed first."""
        assert isinstance(x, DTensor), "a DTensor weight meets a plain input"
        mesh, last = weight.device_mesh, x.ndim - 1
        wanted = tuple(Shard(last) if p.is_shard(1) else Replicate() for p in weight.placements)
        if tuple(x.placements) != wanted:
            x = x.redistribute(mesh, wanted)
        out_placements = [Shard(last) if p.is_shard(0) else Partial() if p.is_shard(1) else Replicate()
                          for p in weight.placements]
        # A whole input times an output-feature shard: each rank's input gradient is a partial sum.
        grad_placements = [Partial() if p.is_shard(0) else q for p, q in zip(weight.placements, wanted)]
        out = self.fp8_linear(x.to_local(grad_placements=grad_placements), weight.to_local())
        return DTensor.from_local(out, mesh, out_placements, run_check=False)

    def linear_many(self, x, weights):
        overlapped = self._overlapped_linear(x, weights)
        if overlapped is not None:
            return overlapped
        return super().linear_many(self._gathered(x), weights)

    def _overlapped_linear(self, x, weights) -> list[DTensor] | None:
        """The matmuls with their sequence-parallel collectives fused in, where the layouts are
        the two they fuse: sequence-sharded input times column-parallel weights (one gather for
        all of them), or feature-sharded input times one row-parallel weight (reduce-scattered
        onto sequence shards). None elsewhere: FP8 blocks (torchao's matmuls own their casts and
        backward) and weights whole on every tp rank take DTensor's collectives."""
        if self.tp_overlap is None or self.fp8_linear is not None or x.ndim != 3:
            return None
        x_placement = _tp_placement(x)
        if x_placement is None or x.shape[SEQ_DIM] % self.tp_group.size:
            return None
        placements = [_tp_placement(w) for w in weights]
        mesh = x.device_mesh
        if x_placement == Shard(SEQ_DIM) and all(p == Shard(0) for p in placements):
            outs = AllGatherLinear.apply(x.to_local(), self.tp_group, self.tp_overlap, *(w.to_local() for w in weights))
            return [DTensor.from_local(out, mesh, _on_tp(mesh, Shard(2)), run_check=False) for out in outs]
        if x_placement == Shard(2) and placements == [Shard(1)]:
            out = LinearReduceScatter.apply(x.to_local(), self.tp_group, self.tp_overlap, weights[0].to_local())
            return [DTensor.from_local(out, mesh, _on_tp(mesh, Shard(SEQ_DIM)), run_check=False)]
        return None

    @staticmethod
    def _gathered(x):
        """`x` whole along the sequence: under an overlapping plan the blocks' matmul inputs arrive
        sequence-sharded, and a matmul that does not gather them itself needs them gathered."""
        if _tp_placement(x) != Shard(SEQ_DIM):
            return x
        return x.redistribute(x.device_mesh, _on_tp(x.device_mesh, Replicate()))

    def _concatenated_linear(self, x, weights):
        if self.fp8_linear is not None:
            # One FP8 cast and GEMM for all the weights: under tensorwise scaling they share one scale.
            return self.fp8_linear(x, torch.cat(weights))
        return super()._concatenated_linear(x, weights)

    def constrain(self, x, axes, region):
        if self.activation_mesh is None:
            return x
        placements = self.plan.activation_placements(axes, region)
        if not isinstance(x, DTensor):
            # A plain tensor here is this rank's input rows, the same on every tp/cp rank.
            return DTensor.from_local(x, self.activation_mesh, placements, run_check=False)
        if tuple(x.placements) != placements:
            x = x.redistribute(self.activation_mesh, placements)
        return x

    def embedding(self, tokens, weight):
        if not isinstance(weight, DTensor):
            return super().embedding(tokens, weight)
        ids = tokens.to_local() if isinstance(tokens, DTensor) else tokens
        local_weight = weight.to_local()
        rows, offset = shard_extent(weight, 0)
        # Vocab-parallel lookup: each rank fills the rows of the ids it holds and zeros elsewhere;
        # the sum over the vocab shards (an all-reduce, or a reduce-scatter under SP) completes it.
        outside = (ids < offset) | (ids >= offset + rows)
        out = F.embedding((ids - offset).masked_fill(outside, 0), local_weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        vocab_dims = {weight.device_mesh.mesh_dim_names[i] for i, p in enumerate(weight.placements) if p.is_shard(0)}
        mesh = self.activation_mesh
        placements = [Partial() if name in vocab_dims else Replicate() for name in mesh.mesh_dim_names]
        return DTensor.from_local(out, mesh, placements, run_check=False)

    def attention_mask(self, document_ids, window=None, chunk=None, *, sinks=False):
        cp_rank = dist.get_rank(self.cp_group) if self.cp_group is not None else 0
        sites = mask_sites(self.cp_method, document_ids.shape[1], self.plan.mesh_spec.cp, cp_rank)

        def kernel_of(whole_row: bool) -> str:
            return self.layout.masked_kernel(whole_row, window, with_lse=sinks)

        return masked_attention.build_mask(document_ids, window, sites, kernel_of, self.device, chunk=chunk)

    def attention(self, q, k, v, mask=None, *, scale=None, sinks=None):
        if not isinstance(q, DTensor):
            return self._local_attention(q, k, v, mask, scale, sinks)
        # Heads are split over tp: each rank attends with its own heads, no communication.
        q_local = q.to_local()
        if k.placements == q.placements:
            k_local, v_local = k.to_local(), v.to_local()
        else:
            k_local, v_local = (self._kv_for_local_queries(t, q) for t in (k, v))
        if sinks is not None:
            sinks = self._sinks_for_local_queries(sinks, q)
        out = self._local_attention(q_local, k_local, v_local, mask, scale, sinks)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

    def _local_attention(self, q, k, v, mask: AttentionMask | None, scale: float | None,
                         sinks: torch.Tensor | None = None):
        if self.cp_group is not None:
            # The sequence is split over cp: attention is the one place those ranks exchange data.
            return context_parallel_attention(q, k, v, group=self.cp_group, method=self.cp_method, mask=mask,
                                              scale=scale, sinks=sinks)
        if sinks is not None:
            return attention_with_sinks(q, k, v, sinks, mask.forms[WHOLE_ROW] if mask is not None else None, scale)
        if mask is None:
            return fused_causal_attention(q, k, v, scale=scale)
        return masked_attention.attend(q, k, v, mask.forms[WHOLE_ROW], scale)

    @staticmethod
    def _sinks_for_local_queries(sinks: torch.Tensor, q: DTensor) -> torch.Tensor:
        """The sink logits of this rank's query heads: their shard where the sinks are split over tp
        with the heads, else this rank's slice of the whole (its gradient a partial sum over tp)."""
        if not isinstance(sinks, DTensor):
            heads, offset = shard_extent(q, 2)
            return sinks[offset:offset + heads]
        local = sinks.to_local()
        heads, offset = shard_extent(q, 2)
        if local.shape[0] == heads and tuple(p.is_shard(0) for p in sinks.placements) == tuple(
                p.is_shard(2) for p in q.placements):
            return local
        whole = sinks.redistribute(sinks.device_mesh, [Replicate()] * sinks.device_mesh.ndim)
        return whole.to_local(grad_placements=[Partial()] * sinks.device_mesh.ndim)[offset:offset + heads]

    @staticmethod
    def _kv_for_local_queries(kv: DTensor, q: DTensor) -> torch.Tensor:
        """The KV heads that this rank's query heads attend with, out of all (replicated) KV heads."""
        heads, offset = shard_extent(q, 2)
        group = q.shape[2] // kv.shape[2]
        first, last = offset // group, (offset + heads - 1) // group
        # Each rank's slice gets its own gradient; they sum over tp into the replicated weight.
        grad_placements = [Partial() if p.is_shard(2) else p for p in q.placements]
        return kv.to_local(grad_placements=grad_placements)[:, :, first:last + 1]

    def cross_entropy_sum(self, logits, labels):
        if not isinstance(logits, DTensor):
            return super().cross_entropy_sum(logits, labels)
        if _tp_placement(logits) == Shard(logits.ndim - 1):
            # The vocab stays split: each rank reduces over its slice and full logits never exist
            # on one rank. Shards as torch.chunk cuts them (DTensor's Shard): the first ones larger.
            vocab, ranks = logits.shape[-1], self.tp_group.size
            vocab_start = min(self.tp_group.rank * -(-vocab // ranks), vocab)
            return VocabParallelCrossEntropySum.apply(logits.to_local(), labels, vocab_start, self.tp_group)
        return super().cross_entropy_sum(logits.full_tensor(), labels)

    def output_cross_entropy_sum(self, h, weight, labels):
        chunk = self.loss_chunk_tokens
        # An FP8 output projection keeps its own matmul (and its casts) on the whole logits.
        if not chunk or self.fp8_linear is not None:
            return self.unfused_output_cross_entropy_sum(h, weight, labels)
        if not isinstance(h, DTensor) and not isinstance(weight, DTensor):
            return linear_cross_entropy_sum(h, weight, labels, chunk, self.compile_loss_chunks)
        h_placement = _tp_placement(h) if isinstance(h, DTensor) else None
        weight_placement = _tp_placement(weight) if isinstance(weight, DTensor) else None
        if h_placement not in (Replicate(), Shard(SEQ_DIM)) or weight_placement not in (Replicate(), Shard(0)):
            return self.unfused_output_cross_entropy_sum(h, weight, labels)
        return _chunked_loss_of_dtensors(h, weight, labels, chunk, self.tp_group, self.compile_loss_chunks)

    def per_token(self, fn, params, x):
        if not isinstance(x, DTensor):
            return fn(params, x)
        # Each tp rank takes its own share of the sequence (no communication from a replicated
        # input; none at all under sequence parallelism), so tp divides the MoE work too.
        mesh = x.device_mesh
        by_sequence = [Shard(1)] * mesh.ndim
        local_x = x.redistribute(mesh, by_sequence).to_local()
        local_params = tree_map_only(DTensor, lambda t: self._whole_for_local_tokens(t, mesh), params)
        return DTensor.from_local(fn(local_params, local_x), mesh, by_sequence, run_check=False)

    def sum_over_token_shards(self, t):
        for group in self.token_shard_groups:
            t = funcol.all_reduce(t, "sum", group)
        return t

    @staticmethod
    def _whole_for_local_tokens(weight: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        """A weight on the tp mesh in full on this rank, for use on this rank's tokens only: its
        gradients are partial sums that DTensor adds up over tp. Expert weights on the expert
        mesh are left to the expert-parallel dispatch."""
        if weight.device_mesh != mesh:
            return weight
        replicated = weight.redistribute(mesh, [Replicate()] * mesh.ndim)
        return replicated.to_local(grad_placements=[Partial()] * mesh.ndim)

    @contextlib.contextmanager
    def kernel_scope(self):
        """Wraps forward and backward: kernel preferences (read when torch.compile traces too)."""
        with contextlib.ExitStack() as stack:
            if torch.cuda.is_available():
                stack.enter_context(sdpa_kernel(CUDA_ATTENTION_PRIORITY, set_priority=True))
            yield


@torch.compiler.disable
def _chunked_loss_of_dtensors(h: DTensor, weight: DTensor, labels: torch.Tensor, chunk: int, tp_group: TpGroup,
                              compile: bool) -> torch.Tensor:
    """`output_cross_entropy_sum` a chunk at a time for an input whole or sequence-sharded over tp
    and a weight whole or vocabulary-sharded over tp. Outside compiled graphs: traced, the local
    tensors of FSDP's gathered weights change requires_grad after the first step, and the head
    would compile again."""
    h = ParallelContext._gathered(h)
    if _tp_placement(weight) == Replicate():
        # The whole vocabulary on every tp rank: each computes the whole loss and gradients.
        return linear_cross_entropy_sum(h.to_local(), weight.to_local(), labels, chunk, compile)
    # This rank's gradient of h is its vocabulary slice's part: DTensor sums them over tp.
    h_local = h.to_local(grad_placements=_on_tp(h.device_mesh, Partial()))
    vocab_start = shard_extent(weight, 0)[1]
    return vocab_parallel_linear_cross_entropy_sum(h_local, weight.to_local(), labels, chunk, vocab_start, tp_group,
                                                   compile)


def _tp_placement(t) -> Placement | None:
    """The placement of `t` on the tp mesh dim, for a DTensor that lives on it and is replicated
    over any other dim; None otherwise."""
    names = t.device_mesh.mesh_dim_names if isinstance(t, DTensor) else None
    if not names or "tp" not in names:
        return None
    index = names.index("tp")
    if any(not p.is_replicate() for i, p in enumerate(t.placements) if i != index):
        return None
    return t.placements[index]


def _on_tp(mesh: DeviceMesh, placement: Placement) -> list[Placement]:
    """`placement` on the tp dim of `mesh`, replicated over the others."""
    return [placement if name == "tp" else Replicate() for name in mesh.mesh_dim_names]
