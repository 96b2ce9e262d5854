"""Data parallelism with FSDP2: parameters, gradients and optimizer state sharded over dp_shard,
replicated over dp_replicate (HSDP). Replicated DP is the same code with dp_shard=1.

On GPU, FSDP2 prefetches the next block's all-gather and overlaps the reduce-scatter of a
block's gradients with the backward of the block before it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallel.mesh import FSDP_SHARD_DIM
from parallel.modules import ModelModule
from parallel.plan import Plan


def data_parallel_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """dp_shard x cp (flattened), with dp_replicate in front for HSDP."""
    if plan.mesh_spec.dp_replicate > 1:
        return mesh["dp_replicate", FSDP_SHARD_DIM]
    return mesh[FSDP_SHARD_DIM]


def apply_fsdp(model: ModelModule, mesh: DeviceMesh, plan: Plan, *, compute_dtype: torch.dtype) -> None:
    dp_mesh = data_parallel_mesh(mesh, plan)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # With one shard there is nothing to free after forward; re-gathering would only cost time.
    # Under pipelining each block runs once per micro-batch: re-gathering it every time would
    # multiply the all-gathers, so blocks stay gathered between forward and backward.
    reshard = plan.mesh_spec.dp_shard * plan.mesh_spec.cp > 1 and plan.mesh_spec.pp == 1
    common = dict(mesh=dp_mesh, mp_policy=policy)
    for block in model.blocks.values():
        fully_shard(block, reshard_after_forward=reshard, **common)
    if not model.tied:
        # Tied embedding and head share one parameter, so both stay in the root's group.
        if model.embed is not None:
            fully_shard(model.embed, reshard_after_forward=reshard, **common)
        if model.head is not None:
            # The backward starts with the head: resharding it after forward would be undone at once.
            fully_shard(model.head, reshard_after_forward=False, **common)
    fully_shard(model, reshard_after_forward=False, **common)
