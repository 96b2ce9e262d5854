"""The model a training run steps: this rank's stages (dtrain/build.py) with their FP8 backend,
and under pipelining the runner of the schedule and the parameters two stages hold."""

from __future__ import annotations

import logging

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from dtrain import build
from dtrain.config import Config
from models import families, flops, mtp
from models.config import LlamaConfig
from parallel import pipeline, precision, tensor_parallel
from parallel.context import ParallelContext
from parallel.delayed_scaling import amax_reduction_dims
from parallel.modules import ModelModule
from parallel.plan import Plan

logger = logging.getLogger("dtrain")


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
    built = build.build_model_parts(config, model_cfg, plan, mesh, expert_mesh=expert_mesh, device=device,
                                    ep_dispatch=ep_dispatch, fp8_linear=fp8)
    if is_main:
        _log_tp_overlap(config, model_cfg, plan)
    if mesh_spec.pp == 1:
        return TrainingModel(built.parts, built.ctx, None, None, fp8)
    p = config.parallel
    num_microbatches = build.num_microbatches(config, mesh_spec)
    depth = flops.mtp_depth(model_cfg)

    def with_targets(aux, packed):  # the labels and the tokens ahead travel as one tensor
        labels, future = mtp.unpack_targets(packed, depth)
        return attrs.evolve(aux, labels=labels, mtp_targets=future)

    runner = pipeline.PipelineRunner(
        built.parts, built.stage_ids, len(built.blocks_per_stage), p.pp_schedule, num_microbatches,
        device, mesh.get_group("pp"), loss_scale, with_targets if depth else None,
    )
    if is_main:
        logger.info("pipeline: %s, %d stages, %d micro-batches per step, blocks per stage %s", p.pp_schedule,
                    len(built.blocks_per_stage), num_microbatches, built.blocks_per_stage)
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
    method = build.tp_overlap_method(config, plan.mesh_spec)
    if method is None:
        return
    t = config.train
    fp8_blocks = precision.fp8_blocks(model_cfg.num_layers, t.fp8_keep_ends)
    unfused = tensor_parallel.unfused_matmuls(plan, fp8=t.fp8 is not None and bool(fp8_blocks), fp8_head=t.fp8_head)
    logger.info("tp overlap: %s%s", method, "; separate collectives for " + ", ".join(unfused) + " matmuls"
                if unfused else "")
