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
from parallel.mesh import fsdp_shard_dim
from parallel.modules import ModelModule
from parallel.plan import Plan


def data_parallel_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """dp_shard x cp (see `fsdp_shard_dim`), with dp_replicate in front for HSDP."""
    shard = fsdp_shard_dim(plan.mesh_spec)
    if plan.mesh_spec.dp_replicate > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard]


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


def reduces_once_by_default(shards: int, cpu_offload: bool) -> bool:
    """Whether an FSDP unit split over `shards` ranks reduces its gradients once per step without
    --fsdp-reduce-once (`set_micro_batch_sync`): with one shard the whole fp32 gradients take the
    memory the fp32 shards would, unless CPU offload keeps the shards in host memory. The planner
    (dtrain/planner/workload.py) asks the same."""
    return shards == 1 and not cpu_offload


def _fully_shard(model: ModelModule, unit: torch.nn.Module, mesh: DeviceMesh, offload: OffloadPolicy, **kwargs) -> None:
    """fully_shard, noting the unit on the model, and whether it reduces once by default."""
    fully_shard(unit, mesh=mesh, offload_policy=offload, **kwargs)
    # The shard dim is the mesh's last (HSDP's replicate dim comes first).
    model.fsdp_units.append((unit, reduces_once_by_default(mesh.size(-1), isinstance(offload, CPUOffloadPolicy))))


def _shard_experts(model: ModelModule, expert_mesh: DeviceMesh, plan: Plan, policy, offload: OffloadPolicy) -> None:
    """Expert weights (split over ep) are sharded over the ranks that hold the same experts:
    edp, with dp_replicate in front for HSDP."""
    spec = plan.mesh_spec
    expert_dp_mesh = expert_mesh["dp_replicate", "edp"] if spec.dp_replicate > 1 else expert_mesh["edp"]
    for layer in model.transformer_layers():
        for name, experts in layer.named_modules():
            if name != "moe.experts" and not name.endswith(".moe.experts"):
                continue
            # Gathered when the block reads its parameters, and kept until the backward is over:
            # the node has no tensor inputs, so FSDP reduces its gradients at the end of backward.
            # Sharded on the dim the plan says (dim 1 where there are fewer local experts than edp ranks).
            _fully_shard(model, experts, expert_dp_mesh, offload, mp_policy=policy, reshard_after_forward=False,
                         shard_placement_fn=lambda param: Shard(plan.expert_fsdp_dim(tuple(param.shape))))


def expert_parameters(model_parts: list[ModelModule], plan: Plan) -> list[torch.Tensor]:
    """The parameters that expert parallelism splits (none when ep=1)."""
    if plan.mesh_spec.ep == 1:
        return []
    return [p for part in model_parts for name, p in part.named_parameters() if plan.is_expert(part.specs[name].axes)]


@torch.no_grad()
def rescale_expert_grads_(expert_params: list[torch.Tensor], plan: Plan, tp_group=None) -> None:
    """FSDP averages expert gradients over the edp x dp_replicate ranks that hold the same
    experts, but each already sums the tokens of the whole ep group (the all-to-all backward
    brings them home): divide by ep once more so they average over every data/context rank like
    all other gradients. (A gradient divide factor in FSDP would do the same on NCCL, but needs a
    PREMUL_SUM reduction that gloo lacks.)"""
    grads = [p.grad.to_local() for p in expert_params if p.grad is not None]
    if not grads:
        return
    torch._foreach_mul_(grads, 1.0 / plan.mesh_spec.ep)
    if plan.mesh_spec.tp > 1:
        # The tp ranks of one ep rank hold the same experts and saw different tokens.
        # On the mesh's device: under CPU offload the gradients are in host memory.
        flat = torch.cat([g.flatten() for g in grads]).to(expert_params[0].device_mesh.device_type)
        dist.all_reduce(flat, group=tp_group)
        torch._foreach_copy_(grads, [chunk.view_as(g).to(g.device) for chunk, g in
                                     zip(flat.split([g.numel() for g in grads]), grads)])


def set_micro_batch_sync(model: ModelModule, last: bool, everywhere: bool) -> None:
    """Before each micro-batch: the gradients of the units this applies to accumulate whole until
    the last backward, which reduces them; parameters a backward gathered stay gathered for the
    next micro-batch's forward. `everywhere` (--fsdp-reduce-once) applies it to every FSDP unit,
    else to those that reduce once by default (`reduces_once_by_default`): reducing a unit of one
    shard after every micro-batch only costs time, FSDP's copy into its reduce buffer (the
    README's benchmarks measure what it cost)."""
    for unit, by_default in model.fsdp_units:
        if everywhere or by_default:
            unit.set_requires_gradient_sync(last, recurse=False)
            unit.set_reshard_after_backward(last, recurse=False)


def blocks_to_reshard(block_names: list[str], plan: Plan, mode: str = "default") -> set[str]:
    """The blocks whose gathered parameters are freed after their forward and gathered again for
    their backward; `mode` is --fsdp-reshard-after-forward."""
    spec = plan.mesh_spec
    if mode == "never" or spec.dp_shard * spec.cp == 1:
        # With one shard there is nothing to free after forward; re-gathering would only cost time.
        return set()
    if mode == "always":
        return set(block_names)
    if spec.pp > 1:
        # Under pipelining each block runs once per micro-batch: re-gathering it every time would
        # multiply the all-gathers, so blocks stay gathered between forward and backward.
        return set()
    # The backward starts with the last block: freeing it after forward would be undone at once.
    return set(block_names[:-1])


def apply_fsdp(model: ModelModule, mesh: DeviceMesh, plan: Plan, *, compute_dtype: torch.dtype,
               expert_mesh: DeviceMesh | None = None, reshard_mode: str = "default", cpu_offload: bool = False) -> None:
    dp_mesh = data_parallel_mesh(mesh, plan)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory makes the copies to and from the GPU asynchronous; there is none without one.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    common = dict(mesh=dp_mesh, offload=offload, mp_policy=policy)
    # Before fully_shard, which takes the all-gather hooks of the parameters it shards: with
    # tensorwise FP8 the blocks' matmul weights are gathered in float8 (precision.py says when).
    precision.wrap_for_float8_all_gather(model, plan.mesh_spec, dp_mesh.device_type)
    if expert_mesh is not None:
        _shard_experts(model, expert_mesh, plan, policy, offload)
    resharded = blocks_to_reshard(list(model.blocks), plan, reshard_mode)
    for name, block in model.blocks.items():
        _fully_shard(model, block, reshard_after_forward=name in resharded, **common)
    if model.mtp is not None:
        # Its parameters are its own; the ones it shares with the embedding and head stay with them.
        # It runs last (and its backward first), so it keeps its gathered parameters, as the last block.
        _fully_shard(model, model.mtp, reshard_after_forward=reshard_mode == "always", **common)
    if not model.tied:
        # Parameters another layer reads (a tied embedding and head, the weights multi-token
        # prediction shares) stay in the root's group, gathered for the whole step.
        if model.embed is not None:
            # Freed after forward like the blocks, whenever any block is.
            _fully_shard(model, model.embed, reshard_after_forward=bool(resharded), **common)
        if model.head is not None:
            # The backward starts with the head: resharding it after forward would be undone at once.
            _fully_shard(model, model.head, reshard_after_forward=False, **common)
    _fully_shard(model, model, reshard_after_forward=False, **common)
