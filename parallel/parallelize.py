"""From layer specs to this rank's model laid out on the mesh, one step after another in the
order they must happen: parameters placed for the model-parallel dims (on `meta`), FP8, recompute,
compile, data parallelism, then real memory and the mesh-independent initial values. Every choice
comes from the layout (parallel/layout.py); nothing here reads an option."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models import mixtral, spec
from parallel import data_parallel, precision, recompute, te_experts, tensor_parallel
from parallel import fp8_experts as fp8_grouped
from parallel.context import ParallelContext
from parallel.layout import ParallelLayout
from parallel.mesh import Meshes
from parallel.modules import ModelModule


def parallelize(layers: list[spec.Layer], layout: ParallelLayout, meshes: Meshes, *, device: torch.device,
                fp8=None) -> ModelModule:
    """This rank's model of `layers` (`model.ctx` its context). On `device=meta` it stays without
    memory until `materialize`. `fp8`: the FP8 matmuls' backend (`precision.fp8_backend`, one for
    all of a rank's pipeline stages), None without FP8."""
    # A model built on `meta` computes on the mesh's device (the dry run's fake tensors: the CPU).
    ctx = ParallelContext(layout, meshes, device=device if device.type != "meta" else None)
    if ctx.tp_overlap == "symm_mem" or layout.async_tp:
        # The tp group's buffers in symmetric memory, for torch's fused matmuls (ours or inductor's).
        tensor_parallel.enable_symmetric_memory(ctx.tp_group)
    model = ModelModule(layers, _param_maker(layout, meshes), ctx)
    if fp8 is not None:
        _apply_fp8(model, layout, ctx, fp8)
    if layout.fp8_experts is not None and layout.fp8_experts.backend == "torchao":
        _apply_fp8_grouped_experts(model, layout)
    options = {"options": {"_micro_pipeline_tp": True}} if layout.async_tp else {}
    for block in model.transformer_layers():
        block.forward_fn = recompute.wrap(block.forward_fn, layout.recompute_of(block.layer_name))
        if layout.compile:
            block.forward_fn = torch.compile(block.forward_fn, **options)
    if layout.compile and model.head is not None:
        # Final norm, output projection and loss in one graph: the cross-entropy over the vocab
        # fuses into a few passes instead of materialising fp32 logits.
        model.head.forward_fn = torch.compile(model.head.forward_fn, **options)
    data_parallel.apply_fsdp(model, meshes, layout)
    if device.type != "meta":
        materialize(model, device, layout.seed, cpu_offload=layout.fsdp.cpu_offload)
    return model


def _param_maker(layout: ParallelLayout, meshes: Meshes):
    """Each parameter on `meta`, placed by the plan: expert weights over the expert mesh's `ep`,
    the others over the model-parallel dims (FSDP shards them further)."""
    plan = layout.plan
    param_mesh = meshes.world[plan.param_mesh_dims] if plan.param_mesh_dims else None

    def make_param(path: str, param: spec.ParamSpec) -> nn.Parameter:
        value = torch.empty(param.shape, device="meta")
        if meshes.experts is not None and plan.is_expert(param.axes):
            value = distribute_tensor(value, meshes.experts["ep"], plan.expert_placements(param.axes),
                                      src_data_rank=None)
        elif param_mesh is not None:
            value = distribute_tensor(value, param_mesh, plan.param_placements(param.axes), src_data_rank=None)
        return nn.Parameter(value, requires_grad=param.trainable)

    return make_param


def _apply_fp8(model: ModelModule, layout: ParallelLayout, ctx: ParallelContext, fp8) -> None:
    """The FP8 layers' contexts: each layer's own matmuls (Transformer Engine's delayed scaling
    keeps state per matmul), and its routed experts' where they run in FP8 too."""
    fp8_modules = [b for b in model.transformer_layers() if b.layer_name in layout.fp8_layers]
    if layout.fp8.head and model.head is not None:
        fp8_modules.append(model.head)
    if not fp8_modules:
        return
    layer_fp8 = fp8.for_layers({m.layer_name: _fp8_matmuls(m.layer_name, model.specs) for m in fp8_modules})
    experts = layout.fp8_experts
    if experts is not None and experts.backend == "te":
        routed = {m.layer_name: _routed_experts(m.layer_name, model.specs) for m in fp8_modules}
        for name, layer_experts in te_experts.for_layers(fp8, {n: e for n, e in routed.items() if e}).items():
            layer_fp8[name].experts = layer_experts
    for module in fp8_modules:
        module.ctx = ctx.with_fp8(layer_fp8[module.layer_name])
        module.forward_fn = layer_fp8[module.layer_name].wrap_forward(module.forward_fn)


def _apply_fp8_grouped_experts(model: ModelModule, layout: ParallelLayout) -> None:
    """torchao's FP8 grouped GEMMs for the routed experts of the blocks that run them: stateless,
    one for all of them, beside whatever their other matmuls run in."""
    grouped = fp8_grouped.Fp8GroupedExperts(native=not layout.fp8_experts.emulated)
    for block in model.transformer_layers():
        if block.layer_name in layout.fp8_experts.layers and _routed_experts(block.layer_name, model.specs):
            block.ctx = block.ctx.with_fp8(block.ctx.fp8_linear, grouped_experts=grouped)


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
