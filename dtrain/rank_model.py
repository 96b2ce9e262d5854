"""This rank's model from a run's layout: the layers split over pipeline stages, and each of this
rank's stages laid out on the mesh by `parallelize` (`build_model_parts`); for training, with
their FP8 backend and, under pipelining, the runner of the schedule and the parameters two stages
hold (`build_training_model`). The trainer and the dry run build it here, so the dry run runs the
program a real run would."""

from __future__ import annotations

import logging

import attrs
import torch

from dtrain.layout import RunLayout
from models import flops, mtp
from parallel import pipeline, tensor_parallel
from parallel.context import ParallelContext
from parallel.delayed_scaling import amax_reduction_dims
from parallel.mesh import Meshes
from parallel.modules import ModelModule
from parallel.parallelize import parallelize
from parallel.precision import fp8_backend

logger = logging.getLogger("dtrain")


@attrs.frozen
class ModelParts:
    """This rank's stages of the model (the whole model when pp=1) and where they sit."""

    parts: list[ModelModule]
    ctx: ParallelContext
    stage_ids: list[int]


def build_model_parts(layout: RunLayout, meshes: Meshes, *, device: torch.device, fp8=None) -> ModelParts:
    """This rank's stages, laid out on the mesh. On `device=meta` they have no memory yet
    (`parallel.parallelize.materialize` gives them some). `fp8`: the FP8 matmuls' backend
    (`parallel.precision.fp8_backend`), None without FP8."""
    layers, split = layout.layers, layout.pipeline
    if split.pp == 1:
        model = parallelize(layers, layout.parallel, meshes, device=device, fp8=fp8)
        return ModelParts([model], model.ctx, [0])
    ids = split.stage_ids(meshes.local_rank("pp"))
    parts = [parallelize(pipeline.stage_layers(layers, list(split.blocks_per_stage), i), layout.parallel, meshes,
                         device=device, fp8=fp8) for i in ids]
    return ModelParts(parts, parts[0].ctx, ids)


@attrs.frozen
class TrainingModel:
    parts: list[ModelModule]  # this rank's stages (the whole model when pp=1)
    ctx: ParallelContext
    runner: pipeline.PipelineRunner | None  # pp > 1
    tied_copies: pipeline.TiedCopies | None  # pp > 1: parameters two stages hold
    fp8: object | None  # the FP8 matmuls' backend (parallel.precision.fp8_backend)


def build_training_model(layout: RunLayout, meshes: Meshes, *, device: torch.device, is_main: bool) -> TrainingModel:
    # Delayed scaling reduces amaxes over the ranks holding other rows or columns of the same tensors.
    fp8 = fp8_backend(layout.parallel.fp8, device, amax_groups=meshes.groups(amax_reduction_dims(layout.mesh.sizes())),
                      grad_scale=layout.loss_scale)
    built = build_model_parts(layout, meshes, device=device, fp8=fp8)
    if is_main:
        _log_tp_overlap(layout)
        _log_fp8_experts(layout)
        _log_fp8(layout, device)
    split = layout.pipeline
    if split.pp == 1:
        return TrainingModel(built.parts, built.ctx, None, None, fp8)
    depth = flops.mtp_depth(layout.model_cfg)

    def with_targets(aux, packed):  # the labels and the tokens ahead travel as one tensor
        labels, future = mtp.unpack_targets(packed, depth)
        return attrs.evolve(aux, labels=labels, mtp_targets=future)

    runner = pipeline.PipelineRunner(
        built.parts, built.stage_ids, split.num_stages, split.schedule, split.num_microbatches,
        device, meshes.group("pp"), layout.loss_scale, with_targets if depth else None,
    )
    if is_main:
        logger.info("pipeline: %s, %d stages, %d micro-batches per step, blocks per stage %s", split.schedule,
                    split.num_stages, split.num_microbatches, list(split.blocks_per_stage))
    tied = pipeline.TiedCopies(layout.layers, list(split.blocks_per_stage), built.parts, meshes.world, split.schedule)
    return TrainingModel(built.parts, built.ctx, runner, tied, fp8)


def _log_fp8(layout: RunLayout, device: torch.device) -> None:
    """Once per run: FP8 that this machine emulates trains in FP8's numerics at no FP8 speed."""
    fp8 = layout.parallel.fp8
    if fp8 is not None and fp8.emulated:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"the {device.type.upper()}"
        logger.warning("--fp8 %s is emulated on %s (no FP8 matmuls): the numerics of FP8, not its speed",
                       fp8.recipe, where)


def _log_tp_overlap(layout: RunLayout) -> None:
    method = layout.parallel.tp_overlap
    if method is None:
        return
    fp8 = layout.parallel.fp8
    unfused = tensor_parallel.unfused_matmuls(layout.plan, fp8=bool(layout.parallel.fp8_layers),
                                              fp8_head=fp8 is not None and fp8.head)
    logger.info("tp overlap: %s%s", method, "; separate collectives for " + ", ".join(unfused) + " matmuls"
                if unfused else "")


def _log_fp8_experts(layout: RunLayout) -> None:
    """Whether the planner expects torchao's FP8 experts to beat bf16 ones at this run's rows per
    expert (balanced routing) on this machine's GPU: a warning where it does not."""
    experts = layout.parallel.fp8_experts
    if experts is None or experts.backend != "torchao":
        return
    from dtrain.planner import gpus

    hw, model_cfg, mesh = gpus.profile(layout.machine.gpu), layout.model_cfg, layout.mesh
    rows = layout.tokens_per_micro_batch / mesh.tp * model_cfg.top_k * mesh.ep / model_cfg.num_experts
    gain = hw.fp8_experts_gain(model_cfg.num_experts, model_cfg.dim, model_cfg.expert_ffn_dim, rows)
    shape = (f"{model_cfg.num_experts} experts of {model_cfg.dim} x {model_cfg.expert_ffn_dim}, about {rows:,.0f} rows "
             f"each per micro-batch")
    if gain > 1:
        logger.info("FP8 experts (torchao's grouped GEMMs): the planner expects them %.2fx as fast as bf16 experts "
                    "(%s, casts included, %s rates)", gain, shape, hw.name)
    else:
        logger.warning("FP8 experts (torchao's grouped GEMMs): the planner expects them slower than bf16 experts "
                       "here (%.2fx; %s, casts included, %s rates): their casts cost more than the FP8 GEMMs save; "
                       "drop --fp8-experts, or give each expert more rows (a larger --micro-batch or ep)",
                       gain, shape, hw.name)
