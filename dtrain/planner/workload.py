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
from dtrain.layout.checks import with_global_batch
from models import families, flops, mixtral, spec
from models.config import MoEConfig
from models.presets import get_model_config
from parallel import data_parallel, pipeline, precision
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
class UnitTotals:
    """What the models read from a rank's FSDP units, summed once per mesh and resharding mode.
    Byte counts of gathered copies are in the compute dtype (1 byte per element of the matmul
    weights FSDP gathers in float8); `share_*` are the parts that FSDP's collectives move
    ((shards - 1) / shards of each unit split over more than one rank)."""

    local: int
    trainable: int
    gathered_trainable: int
    kept_bytes: float          # units not freed after forward
    resharded_bytes: float     # the largest unit freed after forward and gathered again (0: none)
    largest_bytes: float       # the unit with the most trainable elements: its gathered copy,
    largest_gathered_trainable: int  # its gathered trainable elements,
    largest_trainable: int     # and its shard
    share_kept_bytes: float    # all-gathered bytes of the units kept, and of those resharded
    share_resharded_bytes: float
    share_reduced: float       # reduce-scattered elements
    collectives: int           # units split over more than one rank
    first_gather_bytes: float
    last_reduced: float


@attrs.frozen
class Stage:
    index: int
    blocks: tuple[int, ...]  # global block indices, in order; the last stage's MTP layer after them
    first: bool              # holds the embedding
    last: bool               # holds the head and the loss (and the MTP layer, where there is one)


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
    # Per global block: "dense" or "moe"; then, where the model has multi-token prediction, its
    # layer (all its modules) as one more block of kind "mtp-dense" or "mtp-moe".
    block_kinds: tuple[str, ...]
    units_by_kind: dict[str, tuple[Unit, ...]]
    # Per block kind, each matmul weight: (shape on this rank, routed expert, logical axes).
    weights_by_kind: dict[str, tuple[tuple[tuple[int, ...], bool, tuple[str, ...]], ...]]
    embed: Unit
    head: Unit
    fp8_blocks: frozenset[int]
    float8_all_gather: bool             # FSDP gathers the FP8 blocks' matmul weights in float8
    ep_dispatch: str | None
    # Results that depend on the mesh and a few options only, shared by the workloads a search
    # derives from this one (attrs.evolve keeps the same dict).
    memo: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def mtp_depth(self) -> int:
        """The model's multi-token prediction modules (0 without)."""
        return flops.mtp_depth(self.model_cfg)

    def repeats(self, block: int) -> int:
        """How many blocks `block` stands for: the MTP layer's modules, else one."""
        return self.mtp_depth if self.is_mtp(block) else 1

    def is_mtp(self, block: int) -> bool:
        return self.block_kinds[block].startswith("mtp")

    def is_moe(self, block: int) -> bool:
        return self.block_kinds[block].endswith("moe")

    def reduces_once(self, unit: Unit) -> bool:
        """Whether `unit` sums its gradients whole over the step's micro-batches and reduces them
        after the last: under pipelining, with --fsdp-reduce-once, or by default (one shard)."""
        p = self.config.parallel
        return (self.mesh_spec.pp > 1 or p.fsdp_reduce_once
                or data_parallel.reduces_once_by_default(unit.shards, p.cpu_offload))

    @property
    def tp_tokens(self) -> int:
        """Tokens of one micro-batch in the residual stream of a tp rank (split under SP)."""
        return self.tokens // self.mesh_spec.tp if self.plan.sequence_parallel else self.tokens

    def block_units(self, block: int, stage: Stage | None = None) -> tuple[Unit, ...]:
        """The FSDP units of a block: the block, and its routed experts where ep splits them
        (never resharded: data_parallel._shard_experts). Which blocks are resharded follows
        data_parallel.blocks_to_reshard: under the default, all but the last of each model part
        (and never the MTP layer, which runs last)."""
        units = self.units_by_kind[self.block_kinds[block]]
        mode = self.config.parallel.fsdp_reshard_after_forward
        resharded = units[0].shards > 1 and (mode == "always" or (mode == "default" and self.mesh_spec.pp == 1))
        if resharded and mode == "default" and (self.is_mtp(block) or stage is not None and block == max(
                b for b in stage.blocks if not self.is_mtp(b))):
            resharded = False
        return (attrs.evolve(units[0], resharded=True), *units[1:]) if resharded else units

    def stage_units(self, stage: Stage) -> list[Unit]:
        units = [u for block in stage.blocks for u in self.block_units(block, stage)]
        return units + self._ends(stage, units)

    def _ends(self, stage: Stage, block_units: list[Unit]) -> list[Unit]:
        """The embedding (freed after forward when any block is) and the head, where the stage has them."""
        ends = []
        if stage.first and not self.model_cfg.tie_embeddings:
            ends.append(attrs.evolve(self.embed, resharded=any(u.resharded for u in block_units)))
        if stage.last:
            ends.append(self.head)
        return ends

    def units_and_float8(self) -> list[tuple[Unit, bool]]:
        """Every FSDP unit of the rank, and whether FSDP gathers its matmul weights in float8 (a
        block's own unit in an FP8 block, where float8 gathering applies)."""
        key = ("units", self.config.parallel.fsdp_reshard_after_forward)
        if key not in self.memo:
            pairs = []
            for stage in self.stages:
                block_pairs = []
                for block in stage.blocks:
                    float8 = self.float8_all_gather and block in self.fp8_blocks
                    block_pairs += [(u, float8 and i == 0) for i, u in enumerate(self.block_units(block, stage))]
                pairs += block_pairs + [(u, False) for u in self._ends(stage, [u for u, _ in block_pairs])]
            self.memo[key] = pairs
        return self.memo[key]

    def unit_totals(self) -> UnitTotals:
        p, t = self.config.parallel, self.config.train
        key = ("totals", p.fsdp_reshard_after_forward, t.precision)
        if key not in self.memo:
            self.memo[key] = _totals(self.units_and_float8(), 4 if t.precision == "fp32" else 2)
        return self.memo[key]

    def all_units(self) -> list[Unit]:
        return [u for u, _ in self.units_and_float8()]

    def block_mix(self, stage: Stage) -> list[tuple[int, str, int]]:
        """(a block, its recompute mode, how many blocks of the stage are like it): the first
        --recompute-layers blocks recompute in full, the others follow --recompute; blocks of one
        kind and precision under one mode save and cost the same."""
        t = self.config.train
        key = ("mix", stage.index, t.recompute, t.recompute_layers)
        if key not in self.memo:
            mix: dict[tuple, list] = {}
            for i, block in enumerate(stage.blocks):
                mode = "full" if i < t.recompute_layers else t.recompute
                entry = mix.setdefault((self.block_kinds[block], block in self.fp8_blocks, mode), [block, mode, 0])
                entry[2] += 1
            self.memo[key] = [tuple(entry) for entry in mix.values()]
        return self.memo[key]


def workload(config: Config, world_size: int, rank: int = 0, device_type: str = "cuda") -> Workload:
    """The share of `rank` in a world of `world_size` ranks; `config` as the run would resolve it
    (an unset --global-batch means one micro-batch per data-parallel rank)."""
    config = fsdp_as_run(with_global_batch(config, world_size))
    model_cfg = get_model_config(config.model.model, config.model.model_overrides)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    return _workload(config, model_cfg, mesh_spec, rank, device_type)


def fsdp_as_run(config: Config) -> Config:
    """`config` with the resharding and reduce-once that its --dp-mode runs (the models read those)."""
    p = config.parallel
    reshard, once = data_parallel.fsdp_settings(p.dp_mode, p.fsdp_reshard_after_forward, p.fsdp_reduce_once)
    if (reshard, once) == (p.fsdp_reshard_after_forward, p.fsdp_reduce_once):
        return config
    return attrs.evolve(config, parallel=attrs.evolve(p, fsdp_reshard_after_forward=reshard, fsdp_reduce_once=once))


def _workload(config: Config, model_cfg, mesh_spec: MeshSpec, rank: int, device_type: str) -> Workload:
    p, d, t = config.parallel, config.data, config.train
    plan, kinds, units_by_kind, weights_by_kind, embed, head = _tables(
        model_cfg, mesh_spec.tp, mesh_spec.ep, mesh_spec.dp_shard, mesh_spec.cp, p.sequence_parallel)
    num_stages = mesh_spec.pp * p.pp_virtual_stages
    counts = tuple(_block_counts(model_cfg, num_stages, p.pp_layout) if mesh_spec.pp > 1 else (model_cfg.num_layers,))
    pp_rank = rank // (mesh_spec.world_size // mesh_spec.pp)
    ids = pipeline.stage_ids(pp_rank, mesh_spec.pp, p.pp_virtual_stages, p.pp_schedule) if mesh_spec.pp > 1 else [0]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    mtp = tuple(range(model_cfg.num_layers, len(kinds)))  # the MTP layer rides with the last stage
    stages = tuple(Stage(i, tuple(range(starts[i], starts[i] + counts[i])) + (mtp if i == len(counts) - 1 else ()),
                         i == 0, i == len(counts) - 1) for i in ids)
    fsdp_ranks = mesh_spec.dp_shard * mesh_spec.cp
    is_moe = isinstance(model_cfg, MoEConfig)
    fp8 = t.fp8 is not None
    return Workload(
        config=config, model_cfg=model_cfg, mesh_spec=mesh_spec, plan=plan, pp_rank=pp_rank, stages=stages,
        counts=counts, num_microbatches=d.global_batch // (d.micro_batch * mesh_spec.dp_size),
        tokens=d.micro_batch * d.seq_len // mesh_spec.cp, block_kinds=kinds, units_by_kind=units_by_kind,
        weights_by_kind=weights_by_kind, embed=embed, head=head,
        fp8_blocks=frozenset(int(name.split(".")[1]) for name in precision.fp8_blocks(model_cfg.num_layers,
                                                                                         t.fp8_keep_ends)) if fp8 else frozenset(),
        float8_all_gather=(fp8 and t.fp8 == "tensorwise" and t.fp8_all_gather and mesh_spec.tp == 1
                           and fsdp_ranks > 1 and device_type in precision.FLOAT8_COLLECTIVE_DEVICES),
        ep_dispatch=(choose_dispatch(p.ep_dispatch, mesh_spec.ep, model_cfg.top_k, model_cfg.capacity_factor is None)
                     if is_moe and mesh_spec.ep > 1 else None),
    )


@functools.lru_cache(maxsize=1024)
def _tables(model_cfg, tp: int, ep: int, dp_shard: int, cp: int, sequence_parallel: bool):
    """The plan and every FSDP unit's element counts for the sizes that shape them (pp and
    dp_replicate do not): computed once per model and split, however many searches ask."""
    mesh_spec = MeshSpec(dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
    plan = Plan.build(mesh_spec, sequence_parallel=sequence_parallel, num_kv_heads=model_cfg.num_kv_heads)
    layers = _layers(model_cfg)
    kinds = tuple("moe" if isinstance(model_cfg, MoEConfig) and model_cfg.is_moe_layer(i) else "dense"
                  for i in range(model_cfg.num_layers))
    layer_of_kind = {kind: layers[1 + kinds.index(kind)] for kind in set(kinds)}
    mtp = next((layer for layer in layers if layer.name == "mtp"), None)
    if mtp is not None:
        kind = "mtp-moe" if any(mixtral.is_expert_weight(p) for _, p in spec.flatten(mtp.params)) else "mtp-dense"
        kinds += (kind,)
        layer_of_kind[kind] = mtp
    units_by_kind, weights_by_kind = {}, {}
    for kind, layer in layer_of_kind.items():
        units_by_kind[kind] = _block_units(layer, plan, mesh_spec)
        weights_by_kind[kind] = tuple((plan.gathered_shape(param.shape, param.axes), mixtral.is_expert_weight(param),
                                       param.axes) for _, param in spec.flatten(layer.params) if spec.is_matmul_weight(param))
    return (plan, kinds, units_by_kind, weights_by_kind, _unit(layers[0].params, plan, mesh_spec),
            _unit(layers[-1].params, plan, mesh_spec))


@functools.lru_cache(maxsize=64)
def _layers(model_cfg) -> list[spec.Layer]:
    return families.layers(model_cfg)


@functools.lru_cache(maxsize=256)
def _block_counts(model_cfg, num_stages: int, layout: str) -> list[int]:
    return pipeline.block_counts(_layers(model_cfg), num_stages, layout or None, flops.expert_share(model_cfg))


def _block_units(layer: spec.Layer, plan: Plan, mesh_spec: MeshSpec) -> tuple[Unit, ...]:
    """A block is one FSDP unit; under ep its routed experts are a second."""
    params = dict(spec.flatten(layer.params))
    if mesh_spec.ep == 1:
        return (_unit(layer.params, plan, mesh_spec),)
    experts = {k: v for k, v in params.items() if mixtral.is_expert_weight(v)}
    rest = {k: v for k, v in params.items() if k not in experts}
    units = [_unit(rest, plan, mesh_spec)]
    if experts:
        units.append(_unit(experts, plan, mesh_spec))
    return tuple(units)


def _unit(params: dict, plan: Plan, mesh_spec: MeshSpec) -> Unit:
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
    return Unit(local, trainable, gathered, gathered_trainable, matmul, shards)


def _sizes(plan: Plan, shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, int]:
    return math.prod(plan.local_shape(shape, axes)), math.prod(plan.gathered_shape(shape, axes))


def _totals(pairs: list[tuple[Unit, bool]], compute_bytes: int) -> UnitTotals:
    units = [u for u, _ in pairs]
    gathered = [u.matmul + compute_bytes * (u.gathered - u.matmul) if float8 else compute_bytes * u.gathered
                for u, float8 in pairs]
    largest = max(range(len(units)), key=lambda i: units[i].gathered_trainable)
    split = [(u, g, (u.shards - 1) / u.shards) for u, g in zip(units, gathered) if u.shards > 1]
    return UnitTotals(
        local=sum(u.local for u in units), trainable=sum(u.trainable for u in units),
        gathered_trainable=sum(u.gathered_trainable for u in units),
        kept_bytes=sum(g for u, g in zip(units, gathered) if not u.resharded),
        resharded_bytes=max((g for u, g in zip(units, gathered) if u.resharded), default=0.0),
        largest_bytes=gathered[largest], largest_gathered_trainable=units[largest].gathered_trainable,
        largest_trainable=units[largest].trainable,
        share_kept_bytes=sum(g * share for u, g, share in split if not u.resharded),
        share_resharded_bytes=sum(g * share for u, g, share in split if u.resharded),
        share_reduced=sum(u.gathered_trainable * share for u, _, share in split), collectives=len(split),
        first_gather_bytes=split[0][1] * split[0][2] if split else 0.0,
        last_reduced=split[-1][0].gathered_trainable * split[-1][2] if split else 0.0,
    )
