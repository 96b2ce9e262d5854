"""What one rank holds and computes in one training step, read from the sharding plan and the
pipeline split rather than from a formula per model family:

    work = workload(config, world_size=128, rank=0)
    work.stages            # this rank's pipeline stages and their blocks
    work.block_units(3)    # the FSDP units of block 3: elements kept (shards) and gathered
    work.tokens            # tokens of one micro-batch on this rank (after the cp split)

Every element count comes from `Plan.local_shape` / `Plan.gathered_shape` of each parameter
spec, so a change of the plan's rules changes the models that read it. The memory and step-time
models (memory.py, steptime.py) both start here.
"""

from __future__ import annotations

import functools
import math

import attrs

from dtrain.config import Config
from dtrain.plan.validate import build_plan, with_global_batch
from models import families, mixtral, spec
from models.config import MoEConfig, get_model_config
from parallel import pipeline, precision
from parallel.expert_parallel import choose_dispatch
from parallel.mesh import MeshSpec
from parallel.plan import Plan


@attrs.frozen
class Unit:
    """One FSDP unit (a block, a block's routed experts under ep, the embedding, the head):
    element counts on one rank."""

    local: int               # the rank's shards of every parameter (fp32 master weights)
    trainable: int           # of `local`, the elements with gradients and optimizer state
    gathered: int            # what FSDP all-gathers for compute (split over tp or ep only)
    gathered_trainable: int
    matmul: int              # of `gathered`, elements of the 2-D weights an FP8 block casts
    shards: int              # ranks FSDP splits dim 0 over
    resharded: bool = False  # freed after forward and gathered again for backward


@attrs.frozen
class Stage:
    index: int
    blocks: tuple[int, ...]  # global block indices, in order
    first: bool              # holds the embedding
    last: bool               # holds the head and the loss


@attrs.frozen
class Workload:
    config: Config
    model_cfg: families.ModelConfig
    mesh_spec: MeshSpec
    plan: Plan
    pp_rank: int
    stages: tuple[Stage, ...]           # this rank's, in the order it holds them
    counts: tuple[int, ...]             # blocks per stage, every stage
    num_microbatches: int               # per step on this rank
    tokens: int                         # of one micro-batch on this rank
    block_kinds: tuple[str, ...]        # per global block: "dense" or "moe"
    units_by_kind: dict[str, tuple[Unit, ...]]
    embed: Unit
    head: Unit
    fp8_blocks: frozenset[int]
    float8_all_gather: bool             # FSDP gathers the FP8 blocks' matmul weights in float8
    ep_dispatch: str | None

    @property
    def tp_tokens(self) -> int:
        """Tokens of one micro-batch in the residual stream of a tp rank (split under SP)."""
        return self.tokens // self.mesh_spec.tp if self.plan.sequence_parallel else self.tokens

    def block_units(self, block: int, stage: Stage | None = None) -> tuple[Unit, ...]:
        """The FSDP units of a block: the block, and its routed experts where ep splits them.
        Under default resharding the last block of each model part stays gathered."""
        units = self.units_by_kind[self.block_kinds[block]]
        if stage is not None and units[0].resharded and block == stage.blocks[-1] and self._default_reshard:
            units = (attrs.evolve(units[0], resharded=False), *units[1:])
        return units

    @property
    def _default_reshard(self) -> bool:
        return self.config.parallel.fsdp_reshard_after_forward == "default"

    def stage_units(self, stage: Stage) -> list[Unit]:
        units = [u for block in stage.blocks for u in self.block_units(block, stage)]
        if stage.first and not self.model_cfg.tie_embeddings:
            units.append(attrs.evolve(self.embed, resharded=any(u.resharded for u in units)))
        if stage.last:
            units.append(self.head)
        return units

    def all_units(self) -> list[Unit]:
        return [u for stage in self.stages for u in self.stage_units(stage)]


def workload(config: Config, world_size: int, rank: int = 0, device_type: str = "cuda") -> Workload:
    """The share of `rank` in a world of `world_size` ranks; `config` as the run would resolve it
    (an unset --global-batch means one micro-batch per data-parallel rank)."""
    config = with_global_batch(config, world_size)
    model_cfg = get_model_config(config.model.model, config.model.model_overrides)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    return _workload(config, model_cfg, mesh_spec, rank, device_type)


def _workload(config: Config, model_cfg, mesh_spec: MeshSpec, rank: int, device_type: str) -> Workload:
    p, d, t = config.parallel, config.data, config.train
    plan = build_plan(config, mesh_spec, model_cfg)
    layers = _layers(model_cfg)
    num_stages = mesh_spec.pp * p.pp_virtual_stages
    counts = tuple(_block_counts(model_cfg, num_stages, p.pp_layout) if mesh_spec.pp > 1 else (model_cfg.num_layers,))
    pp_rank = rank // (mesh_spec.world_size // mesh_spec.pp)
    ids = pipeline.stage_ids(pp_rank, mesh_spec.pp, p.pp_virtual_stages, p.pp_schedule) if mesh_spec.pp > 1 else [0]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = tuple(Stage(i, tuple(range(starts[i], starts[i] + counts[i])), i == 0, i == len(counts) - 1) for i in ids)
    fsdp_ranks = mesh_spec.dp_shard * mesh_spec.cp
    reshard = p.fsdp_reshard_after_forward == "always" or (
        p.fsdp_reshard_after_forward == "default" and mesh_spec.pp == 1)
    reshard = reshard and fsdp_ranks > 1
    kinds = tuple("moe" if isinstance(model_cfg, MoEConfig) and model_cfg.is_moe_layer(i) else "dense"
                  for i in range(model_cfg.num_layers))
    units_by_kind = {}
    for kind in set(kinds):
        layer = layers[1 + kinds.index(kind)]
        units_by_kind[kind] = _block_units(layer, plan, mesh_spec, reshard)
    is_moe = isinstance(model_cfg, MoEConfig)
    fp8 = t.fp8 is not None
    return Workload(
        config=config, model_cfg=model_cfg, mesh_spec=mesh_spec, plan=plan, pp_rank=pp_rank, stages=stages,
        counts=counts, num_microbatches=d.global_batch // (d.micro_batch * mesh_spec.dp_size),
        tokens=d.micro_batch * d.seq_len // mesh_spec.cp, block_kinds=kinds, units_by_kind=units_by_kind,
        embed=_unit(layers[0].params, plan, mesh_spec, reshard), head=_unit(layers[-1].params, plan, mesh_spec, False),
        fp8_blocks=frozenset(int(name.split(".")[1]) for name in precision.fp8_blocks(model_cfg.num_layers,
                                                                                         t.fp8_keep_ends)) if fp8 else frozenset(),
        float8_all_gather=(fp8 and t.fp8 == "tensorwise" and t.fp8_all_gather and mesh_spec.tp == 1
                           and fsdp_ranks > 1 and device_type in precision.FLOAT8_COLLECTIVE_DEVICES),
        ep_dispatch=(choose_dispatch(p.ep_dispatch, mesh_spec.ep, model_cfg.top_k, model_cfg.capacity_factor is None)
                     if is_moe and mesh_spec.ep > 1 else None),
    )


@functools.lru_cache(maxsize=64)
def _layers(model_cfg) -> list[spec.Layer]:
    return families.layers(model_cfg)


@functools.lru_cache(maxsize=256)
def _block_counts(model_cfg, num_stages: int, layout: str) -> list[int]:
    return pipeline.block_counts(_layers(model_cfg), num_stages, layout or None)


def _block_units(layer: spec.Layer, plan: Plan, mesh_spec: MeshSpec, reshard: bool) -> tuple[Unit, ...]:
    """A block is one FSDP unit; under ep its routed experts are a second, never resharded
    (data_parallel._shard_experts)."""
    params = dict(spec.flatten(layer.params))
    if mesh_spec.ep == 1:
        return (_unit(layer.params, plan, mesh_spec, reshard),)
    experts = {k: v for k, v in params.items() if mixtral.is_expert_weight(v)}
    rest = {k: v for k, v in params.items() if k not in experts}
    units = [_unit(rest, plan, mesh_spec, reshard)]
    if experts:
        units.append(_unit(experts, plan, mesh_spec, False))
    return tuple(units)


def _unit(params: dict, plan: Plan, mesh_spec: MeshSpec, resharded: bool) -> Unit:
    local = trainable = gathered = gathered_trainable = matmul = 0
    shards = 1
    items = spec.flatten(params) if any(isinstance(v, dict) for v in params.values()) else params.items()
    for _, param in items:
        size = _sizes(plan, param.shape, param.axes)
        local += size[0]
        gathered += size[1]
        if param.trainable:
            trainable += size[0]
            gathered_trainable += size[1]
        if precision.is_fp8_matmul_weight(param.axes):
            matmul += size[1]
        shards = max(shards, plan.fsdp_shards(param.axes))
    return Unit(local, trainable, gathered, gathered_trainable, matmul, shards, resharded and shards > 1)


def _sizes(plan: Plan, shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, int]:
    return math.prod(plan.local_shape(shape, axes)), math.prod(plan.gathered_shape(shape, axes))
