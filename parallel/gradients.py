"""The global gradient norm and clipping, correct on every mesh.

A gradient split over some mesh dims contributes the squared norms of its shards summed over
exactly those dims; a gradient replicated over a dim is counted once. Pipeline stages hold
disjoint parameters, so their sums add up over `pp`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _sharded_dims(grad: torch.Tensor) -> tuple[tuple[int, ...], DeviceMesh | None]:
    if not isinstance(grad, DTensor):
        return (), None
    mesh = grad.device_mesh
    assert not any(p.is_partial() for p in grad.placements), grad.placements
    # Anything not replicated is a split: Shard, and the _StridedShard FSDP uses on top of TP.
    dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate() and mesh.size(i) > 1)
    return dims, mesh


def global_grad_norm(params: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all gradients as if they were one unsharded vector (fp32, on device)."""
    grads: dict = defaultdict(list)
    meshes: dict = {}
    for param in params:
        if param.grad is None:
            continue
        dims, mesh = _sharded_dims(param.grad)
        key = (id(mesh), dims)
        meshes[key] = mesh
        grads[key].append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)
    total = None
    for key, locals_ in grads.items():
        # One fused kernel for the norms of all shards of a group.
        partial = torch.stack(torch._foreach_norm(locals_)).float().pow(2).sum()
        mesh = meshes[key]
        if mesh is not None:
            # Under CPU offload the shards are in host memory; their norms reduce on the mesh's device.
            partial = partial.to(mesh.device_type)
        for dim in key[1]:
            dist.all_reduce(partial, group=mesh.get_group(dim))
        total = partial if total is None else total + partial
    if total is None:
        raise RuntimeError("no parameter has a gradient")
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(params: Iterable[torch.Tensor], max_norm: float,
                pp_group: dist.ProcessGroup | None = None,
                optimizer: torch.optim.Optimizer | None = None,
                copies: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scales gradients so their global norm is at most `max_norm` (0 disables); returns the norm
    before clipping. No host synchronisation. `copies` (among `params`) are parameters another
    pipeline stage holds too, with the same gradient: scaled, counted once in the norm.

    A fused Adam/AdamW `optimizer` takes the scale instead: its step divides every gradient by
    `grad_scale` as it reads it, which saves a pass over all gradients in memory."""
    params = [p for p in params if p.grad is not None]
    copy_ids = {id(p) for p in copies}
    norm = global_grad_norm([p for p in params if id(p) not in copy_ids], pp_group)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if optimizer is not None and optimizer.defaults.get("fused"):
            optimizer.grad_scale = 1.0 / scale
        else:
            local_grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            torch._foreach_mul_(local_grads, scale.to(local_grads[0].device))
    return norm
