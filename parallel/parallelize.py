"""From layer specs to a model laid out on the mesh, in the order the steps must happen:
parameters placed for the model-parallel dims (on `meta`), recompute, compile, data parallelism,
then real memory and the mesh-independent initial values."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from models import mixtral, spec
from parallel import data_parallel, precision, recompute, te_experts, tensor_parallel
from parallel.context import ParallelContext
from parallel.modules import ModelModule
from parallel.plan import Plan


def parallelize(layers: list[spec.Layer], plan: Plan, mesh: DeviceMesh, *, device: torch.device,
                seed: int, compute_dtype: torch.dtype, recompute_mode: str = "none",
                compile_blocks: bool = False, async_tp: bool = False, tp_overlap: str | None = None,
                cp_method: str = "allgather", expert_mesh: DeviceMesh | None = None, ep_dispatch: str = "alltoall",
                fp8_linear=None, fp8_layers: frozenset[str] = frozenset(), fp8_head: bool = False,
                fp8_experts: bool = False, fuse_projections: bool = False, loss_chunk_tokens: int = 0,
                reshard_mode: str = "default", attention_kernel: str = "auto",
                full_recompute: frozenset[str] = frozenset(), cpu_offload: bool = False,
                ) -> tuple[ModelModule, ParallelContext]:
    """This rank's model: parameters placed by the plan, blocks wrapped for recompute (the blocks
    named in `full_recompute` fully, the others by `recompute_mode`) and compile, FSDP2 applied.
    On `device=meta` it stays without memory until `materialize`."""
    # A model built on `meta` computes on the mesh's device (the dry run's fake tensors: the CPU).
    ctx = ParallelContext(plan, mesh, cp_method, expert_mesh, device=device if device.type != "meta" else None,
                          compute_dtype=compute_dtype, attention_kernel=attention_kernel)
    ctx.fuse_projections = fuse_projections
    ctx.loss_chunk_tokens = loss_chunk_tokens
    ctx.compile_loss_chunks = compile_blocks
    ctx.compile_experts = compile_blocks
    ctx.ep_dispatch = ep_dispatch
    if async_tp:
        enable_async_tp(mesh)
    if plan.overlaps_tp:
        # Without a method the blocks' inputs are gathered on their own before their matmuls.
        ctx.tp_overlap = tp_overlap
        if tp_overlap == "symm_mem":
            tensor_parallel.enable_symmetric_memory(ctx.tp_group)
    param_mesh = mesh[plan.param_mesh_dims] if plan.param_mesh_dims else None

    def make_param(path: str, param: spec.ParamSpec) -> nn.Parameter:
        value = torch.empty(param.shape, device="meta")
        if expert_mesh is not None and plan.is_expert(param.axes):
            placements = plan.expert_placements(param.axes)
            value = distribute_tensor(value, expert_mesh["ep"], placements, src_data_rank=None)
        elif param_mesh is not None:
            value = distribute_tensor(value, param_mesh, plan.param_placements(param.axes), src_data_rank=None)
        return nn.Parameter(value, requires_grad=param.trainable)

    model = ModelModule(layers, make_param, ctx)
    fp8_modules = [b for b in model.transformer_layers() if b.layer_name in fp8_layers]
    if fp8_head and model.head is not None:
        fp8_modules.append(model.head)
    if fp8_linear is not None and fp8_modules:
        # Each FP8 layer's own matmuls (Transformer Engine's delayed scaling keeps state per matmul).
        layer_fp8 = fp8_linear.for_layers({m.layer_name: _fp8_matmuls(m.layer_name, model.specs)
                                           for m in fp8_modules})
        if fp8_experts:
            routed = {m.layer_name: _routed_experts(m.layer_name, model.specs) for m in fp8_modules}
            for name, experts in te_experts.for_layers(fp8_linear, {n: e for n, e in routed.items() if e}).items():
                layer_fp8[name].experts = experts
        for module in fp8_modules:
            module.ctx = ctx.with_fp8(layer_fp8[module.layer_name])
            module.forward_fn = layer_fp8[module.layer_name].wrap_forward(module.forward_fn)
    for block in model.transformer_layers():
        mode = "full" if block.layer_name in full_recompute else recompute_mode
        block.forward_fn = recompute.wrap(block.forward_fn, mode)
        if compile_blocks:
            block.forward_fn = torch.compile(block.forward_fn)
    if compile_blocks and model.head is not None:
        # Final norm, output projection and loss in one graph: the cross-entropy over the vocab
        # fuses into a few passes instead of materialising fp32 logits.
        model.head.forward_fn = torch.compile(model.head.forward_fn)
    data_parallel.apply_fsdp(model, mesh, plan, compute_dtype=compute_dtype, expert_mesh=expert_mesh,
                             reshard_mode=reshard_mode, cpu_offload=cpu_offload)
    if device.type != "meta":
        materialize(model, device, seed, cpu_offload=cpu_offload)
    return model, ctx


def _fp8_matmuls(layer_name: str, specs: dict[str, spec.ParamSpec]) -> int:
    """The FP8 matmuls of one forward of a layer: one per matmul weight of a block (the
    projections are never fused under FP8 backends that count them), one for the head."""
    if layer_name == "head":
        return 1
    return sum(1 for name, param in specs.items()
               if name.startswith(layer_name + ".") and precision.is_fp8_matmul_weight(param.axes))


def _routed_experts(layer_name: str, specs: dict[str, spec.ParamSpec]) -> int:
    """How many routed experts a layer has (all ranks'), 0 for a dense one."""
    return max((param.shape[0] for name, param in specs.items()
                if name.startswith(layer_name + ".") and mixtral.is_expert_weight(param)), default=0)


def materialize(model: ModelModule, device: torch.device, seed: int, *, cpu_offload: bool = False) -> None:
    """Memory for this rank's shards, set to the mesh-independent initial values: on `device`, or
    in host memory under CPU offload (FSDP copies each block's shards in when it runs)."""
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    # Drawn on the compute device either way: CPU and CUDA generators give other values.
    init_parameters(model, seed, draw_on=device)


def enable_async_tp(mesh: DeviceMesh) -> None:
    """torch.compile's micro-pipelined TP: each sequence-parallel all-gather (reduce-scatter) is
    split and fused with the matmul that consumes (produces) it, over symmetric memory."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh["tp"].get_group().group_name)


@torch.no_grad()
def init_parameters(model: ModelModule, seed: int, draw_on: torch.device | None = None) -> None:
    """Each rank draws the full value of each parameter (on `draw_on`, default where the
    parameter is) and keeps its own shard of it."""
    for name, param in model.named_parameters():
        device = param.device if draw_on is None or draw_on.type == "meta" else draw_on
        copy_full_(param, spec.init_value(model.specs[name], seed, name, device=device))


def _local_part(param: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's storage of `param` and the matching part of `full`, a value of its global shape."""
    if not isinstance(param, DTensor):
        return param, full
    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return param.to_local(), shard.to_local()


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Sets a (possibly sharded) parameter from its full value; no communication."""
    local, part = _local_part(param, full)
    local.copy_(part)


@torch.no_grad()
def add_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Adds a full-shaped value to a (possibly sharded) parameter; no communication."""
    local, part = _local_part(param, full)
    local.add_(part)
