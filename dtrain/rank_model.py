"""This rank's model from a checked configuration: the layers split over pipeline stages, and each
of this rank's stages laid out on the mesh by `parallelize` (`build_model_parts`); for training,
with their FP8 backend and, under pipelining, the runner of the schedule and the parameters two
stages hold (`build_training_model`). The trainer and the dry run build it here, so the dry run
runs the program a real run would."""

from __future__ import annotations

import logging

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config import Config
from models import families, flops, mtp
from models.config import LlamaConfig
from parallel import pipeline, precision, recompute, tensor_parallel
from parallel.context import ParallelContext
from parallel.data_parallel import fsdp_settings
from parallel.delayed_scaling import amax_reduction_dims
from parallel.mesh import MeshSpec
from parallel.modules import ModelModule
from parallel.parallelize import parallelize
from parallel.plan import Plan

logger = logging.getLogger("dtrain")

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@attrs.frozen
class ModelParts:
    """This rank's stages of the model (the whole model when pp=1) and where they sit."""

    parts: list[ModelModule]
    ctx: ParallelContext
    stage_ids: list[int]
    blocks_per_stage: list[int]  # over all pp x virtual stages; [num_layers] when pp=1


def blocks_per_stage(config: Config, model_cfg: LlamaConfig, mesh_spec: MeshSpec) -> list[int]:
    """The pipeline split: `--pp-layout` as given, else balanced by cost."""
    if mesh_spec.pp == 1:
        return [model_cfg.num_layers]
    num_stages = mesh_spec.pp * config.parallel.pp_virtual_stages
    return pipeline.block_counts(families.layers(model_cfg), num_stages, config.parallel.pp_layout,
                                 flops.expert_share(model_cfg))


def num_microbatches(config: Config, mesh_spec: MeshSpec) -> int:
    """Micro-batches per optimizer step on each data-parallel rank."""
    d = config.data
    return d.global_batch // (d.micro_batch * mesh_spec.dp_size)


def loss_reduction_groups(mesh: DeviceMesh, mesh_spec: MeshSpec) -> list:
    """The groups a step's loss is summed over: the data-parallel ranks, and the last pipeline stage."""
    return [mesh.get_group(dim) for dim in ("dp_shard", "dp_replicate", "cp", "pp") if getattr(mesh_spec, dim) > 1]


def tp_overlap_method(config: Config, mesh_spec: MeshSpec) -> str | None:
    """What --tp-overlap resolves to on this machine (tensor_parallel.resolve_method)."""
    p = config.parallel
    return tensor_parallel.resolve_method(p.tp_overlap, sequence_parallel=p.sequence_parallel, tp=mesh_spec.tp,
                                          device_type="cuda" if torch.cuda.is_available() else "cpu",
                                          async_tp=p.async_tp)


def build_model_parts(config: Config, model_cfg: LlamaConfig, plan: Plan, mesh: DeviceMesh, *,
                      expert_mesh: DeviceMesh | None, device: torch.device, ep_dispatch: str | None,
                      fp8_linear=None) -> ModelParts:
    """This rank's stages, laid out on the mesh. On `device=meta` they have no memory yet
    (`parallel.parallelize.materialize` gives them some). `fp8_linear`: the FP8 matmuls' backend
    (`parallel.precision.fp8_backend`), None without --fp8."""
    t, p, mesh_spec = config.train, config.parallel, plan.mesh_spec
    layers = families.layers(model_cfg)
    counts = blocks_per_stage(config, model_cfg, mesh_spec)
    options = dict(
        plan=plan, mesh=mesh, device=device, seed=t.seed, compute_dtype=COMPUTE_DTYPES[t.precision],
        recompute_mode=t.recompute, full_recompute=recompute.full_recompute_blocks(counts, t.recompute_layers),
        compile_blocks=t.compile, async_tp=p.async_tp, tp_overlap=tp_overlap_method(config, mesh_spec),
        cp_method=p.cp_comm, expert_mesh=expert_mesh,
        ep_dispatch=ep_dispatch or "alltoall",
        fp8_linear=fp8_linear,
        fp8_layers=precision.fp8_blocks(model_cfg.num_layers, t.fp8_keep_ends), fp8_head=t.fp8_head,
        fp8_experts=t.fp8_experts, fuse_projections=t.fuse_projections, loss_chunk_tokens=t.loss_chunk_tokens,
        reshard_mode=fsdp_settings(p.dp_mode, p.fsdp_reshard_after_forward, p.fsdp_reduce_once)[0], attention_kernel=t.attention_kernel, cpu_offload=p.cpu_offload,
    )
    if mesh_spec.pp == 1:
        model, ctx = parallelize(layers, **options)
        return ModelParts([model], ctx, [0], counts)
    ids = pipeline.stage_ids(mesh.get_local_rank("pp"), mesh_spec.pp, p.pp_virtual_stages, p.pp_schedule)
    parts = [parallelize(pipeline.stage_layers(layers, counts, i), **options)[0] for i in ids]
    return ModelParts(parts, parts[0].ctx, ids, counts)


@attrs.frozen
class TrainingModel:
    parts: list[ModelModule]  # this rank's stages (the whole model when pp=1)
    ctx: ParallelContext
    runner: pipeline.PipelineRunner | None  # pp > 1
    tied_copies: pipeline.TiedCopies | None  # pp > 1: parameters two stages hold
    fp8: object | None  # the FP8 matmuls' backend (parallel.precision.fp8_backend)


def build_training_model(config: Config, model_cfg: LlamaConfig, plan: Plan, mesh: DeviceMesh, *,
                         expert_mesh: DeviceMesh | None, device: torch.device, ep_dispatch: str | None,
                         loss_scale: float, is_main: bool) -> TrainingModel:
    mesh_spec = plan.mesh_spec
    fp8 = _fp8_backend(config, mesh, mesh_spec, device, loss_scale)
    built = build_model_parts(config, model_cfg, plan, mesh, expert_mesh=expert_mesh, device=device,
                                    ep_dispatch=ep_dispatch, fp8_linear=fp8)
    if is_main:
        _log_tp_overlap(config, model_cfg, plan)
    if mesh_spec.pp == 1:
        return TrainingModel(built.parts, built.ctx, None, None, fp8)
    p = config.parallel
    microbatches = num_microbatches(config, mesh_spec)
    depth = flops.mtp_depth(model_cfg)

    def with_targets(aux, packed):  # the labels and the tokens ahead travel as one tensor
        labels, future = mtp.unpack_targets(packed, depth)
        return attrs.evolve(aux, labels=labels, mtp_targets=future)

    runner = pipeline.PipelineRunner(
        built.parts, built.stage_ids, len(built.blocks_per_stage), p.pp_schedule, microbatches,
        device, mesh.get_group("pp"), loss_scale, with_targets if depth else None,
    )
    if is_main:
        logger.info("pipeline: %s, %d stages, %d micro-batches per step, blocks per stage %s", p.pp_schedule,
                    len(built.blocks_per_stage), microbatches, built.blocks_per_stage)
    tied = pipeline.TiedCopies(families.layers(model_cfg), built.blocks_per_stage, built.parts, mesh, p.pp_schedule)
    return TrainingModel(built.parts, built.ctx, runner, tied, fp8)


def _fp8_backend(config: Config, mesh: DeviceMesh, mesh_spec, device: torch.device, loss_scale: float):
    """The FP8 matmuls' backend; delayed scaling reduces amaxes over the ranks holding other rows
    or columns of the same tensors (delayed_scaling.amax_reduction_dims)."""
    t = config.train
    groups = [mesh.get_group(dim) for dim in amax_reduction_dims(mesh_spec.sizes())]
    return precision.fp8_backend(t.fp8, t.fp8_backend, device, float8_all_gather=t.fp8_all_gather,
                                 amax_groups=groups, grad_scale=loss_scale, amax_history_len=t.fp8_amax_history)


def _log_tp_overlap(config: Config, model_cfg: LlamaConfig, plan: Plan) -> None:
    method = tp_overlap_method(config, plan.mesh_spec)
    if method is None:
        return
    t = config.train
    fp8_blocks = precision.fp8_blocks(model_cfg.num_layers, t.fp8_keep_ends)
    unfused = tensor_parallel.unfused_matmuls(plan, fp8=t.fp8 is not None and bool(fp8_blocks), fp8_head=t.fp8_head)
    logger.info("tp overlap: %s%s", method, "; separate collectives for " + ", ".join(unfused) + " matmuls"
                if unfused else "")
