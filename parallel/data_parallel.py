"""Data parallelism with FSDP2: parameters, gradients and optimizer state sharded over dp_shard,
replicated over dp_replicate (HSDP). Replicated DP is the same code with dp_shard=1.

On GPU, FSDP2 prefetches the next block's all-gather and overlaps the reduce-scatter of a
block's gradients with the backward of the block before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from models.errors import UserError
from parallel import precision
from parallel.layout import FSDPLayout, ParallelLayout
from parallel.mesh import MeshSpec, Meshes
from parallel.modules import ModelModule
from parallel.plan import Plan

DP_MODES = ("fsdp", "zero1")


def fsdp_settings(dp_mode: str, reshard_mode: str, reduce_once: bool) -> tuple[str, bool]:
    """(--fsdp-reshard-after-forward, --fsdp-reduce-once) as a data-parallel mode runs them. zero1
    (the distributed optimizer of Megatron, ZeRO stage 1) keeps every unit's parameters gathered
    from the step's first forward to its last backward and reduces the whole gradients once: one
    all-gather of the compute copies and one reduce-scatter of the fp32 gradients per unit and
    step, whatever the micro-batches; each rank's AdamW steps its shard of the fp32 weights."""
    if dp_mode not in DP_MODES:
        raise UserError(f"unknown --dp-mode {dp_mode!r}; choose one of {', '.join(DP_MODES)}")
    if dp_mode == "fsdp":
        return reshard_mode, reduce_once
    if reshard_mode == "always":
        raise UserError("--dp-mode zero1 keeps the parameters gathered through the step; --fsdp-reshard-after-forward "
                        "always frees them after each forward: drop one of them")
    return "never", True


def units_to_reshard(block_names: list[str], spec: MeshSpec, mode: str, has_mtp: bool) -> frozenset[str]:
    """The FSDP units whose gathered parameters are freed after their forward and gathered again
    for their backward (`mode` is --fsdp-reshard-after-forward as the data-parallel mode runs it):
    blocks, the multi-token prediction layer (`mtp`) and the embedding (`embed`, freed whenever a
    block is). The head, the routed experts and the root keep theirs through the step."""
    if mode == "never" or spec.dp_shard * spec.cp == 1:
        # With one shard there is nothing to free after forward; re-gathering would only cost time.
        return frozenset()
    if mode == "always":
        blocks = list(block_names) + ["mtp"] * has_mtp
    elif spec.pp > 1:
        # Under pipelining each block runs once per micro-batch: re-gathering it every time would
        # multiply the all-gathers, so blocks stay gathered between forward and backward.
        blocks = []
    else:
        # The backward starts with the last block (the MTP layer runs after it): freeing it after
        # forward would be undone at once.
        blocks = list(block_names[:-1])
    return frozenset(blocks + ["embed"] * bool(blocks))


def _fully_shard(model: ModelModule, unit: torch.nn.Module, mesh: DeviceMesh, offload: OffloadPolicy,
                 fsdp: FSDPLayout, **kwargs) -> None:
    """fully_shard, noting the unit on the model, and whether it reduces once per step."""
    fully_shard(unit, mesh=mesh, offload_policy=offload, **kwargs)
    # The shard dim is the mesh's last (HSDP's replicate dim comes first).
    model.fsdp_units.append((unit, fsdp.reduces_once(mesh.size(-1))))


def _shard_experts(model: ModelModule, meshes: Meshes, plan: Plan, fsdp: FSDPLayout, policy,
                   offload: OffloadPolicy) -> None:
    """Expert weights (split over ep) are sharded over the ranks that hold the same experts:
    edp, with dp_replicate in front for HSDP."""
    expert_dp_mesh = meshes.submesh(plan.mesh_spec.expert_fsdp_dims)
    for layer in model.transformer_layers():
        for name, experts in layer.named_modules():
            if name != "moe.experts" and not name.endswith(".moe.experts"):
                continue
            # Gathered when the block reads its parameters, and kept until the backward is over:
            # the node has no tensor inputs, so FSDP reduces its gradients at the end of backward.
            # Sharded on the dim the plan says (dim 1 where there are fewer local experts than edp ranks).
            _fully_shard(model, experts, expert_dp_mesh, offload, fsdp, mp_policy=policy, reshard_after_forward=False,
                         shard_placement_fn=lambda param: Shard(plan.expert_fsdp_dim(tuple(param.shape))))


def expert_parameters(model_parts: list[ModelModule], plan: Plan) -> list[torch.Tensor]:
    """The parameters that expert parallelism splits (none when ep=1)."""
    if plan.mesh_spec.ep == 1:
        return []
    return [p for part in model_parts for name, p in part.named_parameters() if plan.is_expert(part.specs[name].axes)]


@torch.no_grad()
def rescale_expert_grads_(expert_params: list[torch.Tensor], spec: MeshSpec, sum_groups: list) -> None:
    """The expert gradients times `spec.expert_grad_scale`, summed over `sum_groups` (those of
    `spec.expert_grad_sum_dims`). (A gradient divide factor in FSDP would scale them the same on
    NCCL, but needs a PREMUL_SUM reduction that gloo lacks.)"""
    grads = [p.grad.to_local() for p in expert_params if p.grad is not None]
    if not grads:
        return
    torch._foreach_mul_(grads, spec.expert_grad_scale)
    if sum_groups:
        # On the mesh's device: under CPU offload the gradients are in host memory.
        flat = torch.cat([g.flatten() for g in grads]).to(expert_params[0].device_mesh.device_type)
        for group in sum_groups:
            dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, [chunk.view_as(g).to(g.device) for chunk, g in
                                     zip(flat.split([g.numel() for g in grads]), grads)])


def set_micro_batch_sync(model: ModelModule, last: bool) -> None:
    """Before each micro-batch: the gradients of the units that reduce once per step
    (`FSDPLayout.reduces_once`) accumulate whole until the last backward, which reduces them;
    parameters a backward gathered stay gathered for the next micro-batch's forward."""
    for unit, reduces_once in model.fsdp_units:
        if reduces_once:
            unit.set_requires_gradient_sync(last, recurse=False)
            unit.set_reshard_after_backward(last, recurse=False)


def apply_fsdp(model: ModelModule, meshes: Meshes, layout: ParallelLayout) -> None:
    plan, fsdp = layout.plan, layout.fsdp
    dp_mesh = meshes.submesh(plan.mesh_spec.fsdp_dims)
    policy = MixedPrecisionPolicy(param_dtype=layout.compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory makes the copies to and from the GPU asynchronous; there is none without one.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fsdp.cpu_offload else OffloadPolicy()
    common = dict(mesh=dp_mesh, offload=offload, fsdp=fsdp, mp_policy=policy)
    # Before fully_shard, which takes the all-gather hooks of the parameters it shards: with
    # tensorwise FP8 the blocks' matmul weights are gathered in float8 where the layout says so.
    if layout.fp8 is not None and layout.fp8.all_gather:
        precision.wrap_for_float8_all_gather(model)
    if meshes.experts is not None:
        _shard_experts(model, meshes, plan, fsdp, policy, offload)
    resharded = fsdp.resharded
    for block in model.blocks.values():
        _fully_shard(model, block, reshard_after_forward=block.layer_name in resharded, **common)
    if model.mtp is not None:
        # Its parameters are its own; the ones it shares with the embedding and head stay with them.
        _fully_shard(model, model.mtp, reshard_after_forward="mtp" in resharded, **common)
    if not model.tied:
        # Parameters another layer reads (a tied embedding and head, the weights multi-token
        # prediction shares) stay in the root's group, gathered for the whole step.
        if model.embed is not None:
            _fully_shard(model, model.embed, reshard_after_forward="embed" in resharded, **common)
        if model.head is not None:
            # The backward starts with the head: resharding it after forward would be undone at once.
            _fully_shard(model, model.head, reshard_after_forward=False, **common)
    _fully_shard(model, model, reshard_after_forward=False, **common)
