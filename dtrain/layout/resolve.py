"""`resolve`: a run's options, checked once and decided once, as a `RunLayout`.

    layout = resolve(load_config(argv), world_size=8, machine=Machine.detect())
    cheaper = with_choices(layout, micro_batch=2, recompute="selective")   # the same mesh, other choices

First every check (checks.py: a user's mistake is one `UserError` line), then every decision, each
made by the function of parallel/ that owns its rule: the mesh and its roles, the sharding plan,
the pipeline split, the tp overlap, the expert dispatch, masked attention's kernels, FP8's layers
and float8 all-gather, then what the micro-batch, recompute, data-parallel mode and offload
choose. `with_choices` redoes only that part, so the planner scores thousands of variants of one
mesh through the same code a run takes. Last, the options left unset that the memory model sizes
for the GPU are chosen among such variants (defaults.py).
"""

from __future__ import annotations

import functools
import logging

import attrs

from dtrain.config import Config
from dtrain.layout import checks, defaults
from dtrain.layout.machine import Machine
from dtrain.layout.run_layout import RunLayout
from models import families, flops
from models.config import MoEConfig
from models.presets import get_model_config
from parallel import data_parallel, masked_attention, pipeline, precision, recompute, tensor_parallel
from parallel.expert_parallel import choose_dispatch
from parallel.layout import COMPUTE_DTYPES, FP8ExpertsLayout, FP8Layout, FSDPLayout, ParallelLayout, PipelineLayout
from parallel.mesh import MeshSpec
from parallel.plan import Plan

logger = logging.getLogger("dtrain")

# Micro-batches per step per pipeline stage when --global-batch is not given (`_default_global_batch`).
DEFAULT_MICROBATCHES_PER_STAGE = 2
# The options `with_choices` may change: (group, field).
CHOICES = {"micro_batch": "data", "global_batch": "data", "recompute": "train", "recompute_layers": "train",
           "dp_mode": "parallel", "fsdp_reshard_after_forward": "parallel", "fsdp_reduce_once": "parallel",
           "cpu_offload": "parallel"}


def resolve(config: Config, world_size: int | None, machine: Machine, planned: bool = False) -> RunLayout:
    """The run of `config` on `world_size` ranks (None: the product of the --mesh sizes) of
    `machine`: every check of its options, then every decision. `--mesh auto` is the planner's to
    choose first (dtrain.planner.advice.resolve_run); `planned`: the planner chose the layout, so
    no option is chosen again for the GPU (defaults.py)."""
    model_cfg = get_model_config(config.model.model, config.model.model_overrides)
    mesh = MeshSpec.parse(config.parallel.mesh, world_size)
    unset, memory_gb = defaults.unset_sizes(config), defaults.memory_to_size_for(config, machine)
    config = _with_global_batch(defaults.first_micro_batch(config, memory_gb), mesh)
    checks.check_options(config, mesh.world_size)
    checks.check_split(config, model_cfg, mesh, machine)
    p, t = config.parallel, config.train
    split = PipelineLayout(pp=mesh.pp, schedule=p.pp_schedule, virtual_stages=p.pp_virtual_stages,
                           blocks_per_stage=_blocks_per_stage(model_cfg, mesh.pp * p.pp_virtual_stages, p.pp_layout)
                           if mesh.pp > 1 else (model_cfg.num_layers,), num_microbatches=0)
    split, chosen = _choices(config, model_cfg, mesh, split)
    tp_overlap = tensor_parallel.resolve_method(p.tp_overlap, sequence_parallel=p.sequence_parallel, tp=mesh.tp,
                                                device_type=machine.device_type, async_tp=p.async_tp,
                                                symm_mem=machine.symm_mem)
    checks.check_kernels(config, model_cfg, mesh, machine, tp_overlap)
    checks.check_inputs(config)
    if p.dry_run:
        checks.check_dry_run(config)
    plan = Plan.build(mesh, sequence_parallel=p.sequence_parallel, num_kv_heads=model_cfg.num_kv_heads,
                      tp_overlap=tp_overlap is not None)
    parallel = ParallelLayout(
        plan, precision=t.precision, seed=t.seed, compile=t.compile, async_tp=p.async_tp, tp_overlap=tp_overlap,
        cp_comm=p.cp_comm,
        ep_dispatch=(choose_dispatch(p.ep_dispatch, mesh.ep, model_cfg.top_k, dropless=model_cfg.capacity_factor is None)
                     if isinstance(model_cfg, MoEConfig) and mesh.ep > 1 else None),
        attention_kernel=t.attention_kernel,
        masked_kernels=masked_attention.kernels(t.attention_kernel, machine.device_type, COMPUTE_DTYPES[t.precision]),
        fp8=_fp8_layout(config, model_cfg, mesh, machine), fp8_experts=_fp8_experts_layout(config, model_cfg, machine),
        fuse_projections=t.fuse_projections,
        loss_chunk_tokens=t.loss_chunk_tokens, **chosen)
    layout = RunLayout(config, machine, model_cfg, mesh, split, parallel)
    if not planned:
        vary = functools.partial(_vary, default_global_batch="global_batch" in unset)
        layout = defaults.choose(layout, memory_gb, vary, unset)
    if "global_batch" in unset and mesh.pp > 1:
        _log_default_global_batch(layout)
    return layout


def with_choices(layout: RunLayout, **choices) -> RunLayout:
    """`layout` with other values of the options in CHOICES (the micro-batch, recompute, the
    data-parallel mode and CPU offload), checked and decided as `resolve` does them."""
    assert choices.get("micro_batch", 1) >= 1, choices
    by_group: dict[str, dict] = {}
    for name, value in choices.items():
        by_group.setdefault(CHOICES[name], {})[name] = value
    config = layout.config
    config = attrs.evolve(config, **{group: attrs.evolve(getattr(config, group), **changes)
                                     for group, changes in by_group.items()})
    split, chosen = _choices(config, layout.model_cfg, layout.mesh, layout.pipeline)
    return attrs.evolve(layout, config=config, pipeline=split, parallel=attrs.evolve(layout.parallel, **chosen),
                        chosen=tuple(choice for choice in layout.chosen if choice.option not in choices))


def _vary(layout: RunLayout, default_global_batch: bool, **choices) -> RunLayout:
    """`with_choices`, where another micro-batch of an unset --global-batch brings its own default."""
    if default_global_batch and "micro_batch" in choices:
        choices["global_batch"] = _default_global_batch(choices["micro_batch"], layout.mesh)
    return with_choices(layout, **choices)


def _choices(config: Config, model_cfg, mesh: MeshSpec, split: PipelineLayout) -> tuple[PipelineLayout, dict]:
    """What the micro-batch, recompute, data-parallel mode and offload choose: the pipeline's
    micro-batches, and the ParallelLayout fields they decide."""
    p, t, d = config.parallel, config.train, config.data
    checks.check_choices(config, model_cfg, mesh, split.blocks_per_stage)
    reshard, reduce_once = data_parallel.fsdp_settings(p.dp_mode, p.fsdp_reshard_after_forward, p.fsdp_reduce_once)
    fsdp = FSDPLayout(dp_mode=p.dp_mode, cpu_offload=p.cpu_offload,
                      resharded=_units_to_reshard(model_cfg.num_layers, mesh, reshard, flops.mtp_depth(model_cfg) > 0),
                      # A pipeline schedule reduces every unit once, after the step's last backward.
                      reduce_once=mesh.pp > 1 or reduce_once)
    split = attrs.evolve(split, num_microbatches=d.global_batch // (d.micro_batch * mesh.dp_size))
    return split, dict(recompute=t.recompute, fsdp=fsdp,
                       full_recompute=_full_recompute(split.blocks_per_stage, t.recompute_layers))


def _fp8_layout(config: Config, model_cfg, mesh: MeshSpec, machine: Machine) -> FP8Layout | None:
    t = config.train
    if t.fp8 is None:
        return None
    blocker = precision.float8_all_gather_blocker(t.fp8, t.fp8_backend, t.fp8_all_gather, mesh, machine.device_type)
    return FP8Layout(recipe=t.fp8, backend=t.fp8_backend, layers=precision.fp8_blocks(model_cfg.num_layers,
                                                                                        t.fp8_keep_ends),
                     head=t.fp8_head, all_gather=blocker is None, all_gather_blocker=blocker,
                     amax_history=t.fp8_amax_history, emulated=not _runs_fp8_gemms(machine))


def _fp8_experts_layout(config: Config, model_cfg, machine: Machine) -> FP8ExpertsLayout | None:
    """--fp8-experts: the routed experts of the blocks FP8 covers (--fp8-keep-ends leaves out the
    first and last, with or without --fp8) in FP8 grouped GEMMs: Transformer Engine's under its
    backend (beside its FP8 matmuls), else torchao's."""
    t = config.train
    if not t.fp8_experts:
        return None
    return FP8ExpertsLayout(backend=t.fp8_backend, layers=precision.fp8_blocks(model_cfg.num_layers, t.fp8_keep_ends),
                            emulated=not _runs_fp8_gemms(machine))


def _runs_fp8_gemms(machine: Machine) -> bool:
    return machine.device_type == "cuda" and machine.fp8_matmuls


def _with_global_batch(config: Config, mesh: MeshSpec) -> Config:
    d = config.data
    if d.global_batch is not None:
        return config
    return attrs.evolve(config, data=attrs.evolve(d, global_batch=_default_global_batch(d.micro_batch, mesh)))


def _default_global_batch(micro_batch: int, mesh: MeshSpec) -> int:
    """`--global-batch` unset means one micro-batch per data-parallel rank, and with pp > 1,
    2 x pp of them: enough for every schedule (a multiple of pp) and a bubble of at most a third
    with 1F1B, (pp - 1) / (3 pp - 1), where pp would leave it near a half. 1F1B holds at most pp
    micro-batches on a stage whatever the number per step; GPipe and looped BFS hold all of them."""
    return micro_batch * mesh.dp_size * (1 if mesh.pp == 1 else DEFAULT_MICROBATCHES_PER_STAGE * mesh.pp)


def _log_default_global_batch(layout: RunLayout) -> None:
    d, p, pp, per_rank = layout.config.data, layout.config.parallel, layout.mesh.pp, layout.num_microbatches
    bubble = pipeline.ideal_bubble(pp, p.pp_virtual_stages, per_rank)
    logger.info("pipeline: no --global-batch given: %d micro-batches of %d per step on each data-parallel rank "
                "(2 x pp=%d; ideal %s bubble %.0f%%), global batch %d; set --global-batch to choose",
                per_rank, d.micro_batch, pp, p.pp_schedule, 100 * bubble, d.global_batch)


@functools.lru_cache(maxsize=256)
def _blocks_per_stage(model_cfg, num_stages: int, pp_layout: str) -> tuple[int, ...]:
    """The pipeline split: `--pp-layout` as given, else balanced by cost."""
    return tuple(pipeline.block_counts(families.layers(model_cfg), num_stages, pp_layout or None,
                                       flops.expert_share(model_cfg)))


# The decisions `with_choices` makes again for each variant, computed once per distinct input (the
# planner asks for tens of thousands of variants of a few thousand meshes).
@functools.lru_cache(maxsize=4096)
def _units_to_reshard(num_layers: int, mesh: MeshSpec, mode: str, has_mtp: bool) -> frozenset[str]:
    return data_parallel.units_to_reshard([f"blocks.{i}" for i in range(num_layers)], mesh, mode, has_mtp)


@functools.lru_cache(maxsize=4096)
def _full_recompute(blocks_per_stage: tuple[int, ...], recompute_layers: int) -> frozenset[str]:
    """The first `recompute_layers` blocks of each stage (--recompute-layers), fully recomputed."""
    return recompute.full_recompute_blocks(list(blocks_per_stage), recompute_layers)
