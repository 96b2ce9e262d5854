"""What one rank holds and computes in one training step, read from the run's layout (the
sharding plan, the pipeline split, and its decisions per FSDP unit, block and kernel) rather than
from a formula per model family or a rule of its own:

    work = workload(resolve(config, 128, Machine.gpu_profile("h200")), rank=0)
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
from dtrain.layout import RunLayout
from models import families, flops, masking, mixtral, spec
from models.config import MoEConfig, layer_kind
from parallel.mesh import MeshSpec
from parallel.plan import Plan
from parallel.precision import is_fp8_matmul_weight


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
    layout: RunLayout
    pp_rank: int
    stages: tuple[Stage, ...]           # this rank's, in the order it holds them
    # Per global block: "dense" or "moe"; then, where the model has multi-token prediction, its
    # layer (all its modules) as one more block of kind "mtp-dense" or "mtp-moe".
    block_kinds: tuple[str, ...]
    # Per global block (the MTP layer's too): the attention kind of its layer (models.config.LAYER_KINDS).
    attention_kinds: tuple[str, ...]
    units_by_kind: dict[str, tuple[Unit, ...]]
    # Per block kind, each matmul weight: (shape on this rank, routed expert, logical axes).
    weights_by_kind: dict[str, tuple[tuple[tuple[int, ...], bool, tuple[str, ...]], ...]]
    embed: Unit
    head: Unit
    fp8_blocks: frozenset[int]          # the blocks whose matmuls run in FP8
    # Results that depend on the mesh and a few choices only, shared by the workloads a search
    # derives from this one (`with_layout` keeps the same dict).
    memo: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def config(self) -> Config:
        return self.layout.config

    @property
    def model_cfg(self) -> families.ModelConfig:
        return self.layout.model_cfg

    @property
    def mesh_spec(self) -> MeshSpec:
        return self.layout.mesh

    @property
    def plan(self) -> Plan:
        return self.layout.plan

    @property
    def counts(self) -> tuple[int, ...]:
        """Blocks per stage, every stage."""
        return self.layout.pipeline.blocks_per_stage

    @property
    def num_microbatches(self) -> int:
        """Per step on this rank."""
        return self.layout.num_microbatches

    @property
    def tokens(self) -> int:
        """Of one micro-batch on this rank."""
        return self.layout.tokens_per_micro_batch

    @property
    def float8_all_gather(self) -> bool:
        """FSDP gathers the FP8 blocks' matmul weights in float8."""
        return self.layout.parallel.fp8 is not None and self.layout.parallel.fp8.all_gather

    @property
    def ep_dispatch(self) -> str | None:
        return self.layout.parallel.ep_dispatch

    @property
    def fp8_expert_blocks(self) -> frozenset[int]:
        """The blocks whose routed experts run torchao's FP8 grouped GEMMs."""
        experts = self.layout.parallel.fp8_experts
        return _block_indices(experts.layers) if experts is not None and experts.backend == "torchao" else frozenset()

    def with_layout(self, layout: RunLayout) -> Workload:
        """This rank's workload under another variant of the same mesh (`dtrain.layout.with_choices`)."""
        return attrs.evolve(self, layout=layout)

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

    def layer_name(self, block: int) -> str:
        return "mtp" if self.is_mtp(block) else f"blocks.{block}"

    def attention_extent(self, block: int) -> dict[str, int | None]:
        """The window and the chunk `block`'s attention is limited to (None: not limited)."""
        return masking.mask_extent(self.model_cfg, masking.mask_kind(self.attention_kinds[block]))

    def reduces_once(self, unit: Unit) -> bool:
        """Whether `unit` sums its gradients whole over the step's micro-batches and reduces them
        after the last (the layout's decision per unit)."""
        return self.layout.parallel.fsdp.reduces_once(unit.shards)

    def block_units(self, block: int) -> tuple[Unit, ...]:
        """The FSDP units of a block: the block, freed after forward where the layout says so, and
        its routed experts where ep splits them (never freed after forward)."""
        kind = self.block_kinds[block]
        if self.layer_name(block) not in self.layout.parallel.fsdp.resharded:
            return self.units_by_kind[kind]
        key = ("resharded", kind)
        if key not in self.memo:
            units = self.units_by_kind[kind]
            self.memo[key] = (attrs.evolve(units[0], resharded=True), *units[1:])
        return self.memo[key]

    def _ends(self, stage: Stage) -> list[Unit]:
        """The embedding and the head, where the stage has them. A last stage with the MTP layer
        holds a copy of the embedding for it, which it also trains."""
        ends = []
        holds_embed = stage.first or (stage.last and self.mtp_depth > 0)
        if holds_embed and not self.model_cfg.tie_embeddings:
            ends.append(attrs.evolve(self.embed, resharded="embed" in self.layout.parallel.fsdp.resharded))
        if stage.last:
            ends.append(self.head)
        return ends

    def units_and_float8(self) -> list[tuple[Unit, bool]]:
        """Every FSDP unit of the rank, and whether FSDP gathers its matmul weights in float8 (a
        block's own unit in an FP8 block, where float8 gathering applies)."""
        key = ("units", self.layout.parallel.fsdp.resharded)
        if key not in self.memo:
            pairs = []
            for stage in self.stages:
                for block in stage.blocks:
                    float8 = self.float8_all_gather and block in self.fp8_blocks
                    pairs += [(u, float8 and i == 0) for i, u in enumerate(self.block_units(block))]
                pairs += [(u, False) for u in self._ends(stage)]
            self.memo[key] = pairs
        return self.memo[key]

    def unit_totals(self) -> UnitTotals:
        key = ("totals", self.layout.parallel.fsdp.resharded, self.layout.parallel.precision)
        if key not in self.memo:
            self.memo[key] = _totals(self.units_and_float8(), 4 if self.layout.parallel.precision == "fp32" else 2)
        return self.memo[key]

    def all_units(self) -> list[Unit]:
        return [u for u, _ in self.units_and_float8()]

    def block_mix(self, stage: Stage) -> list[tuple[int, str, int]]:
        """(a block, its recompute mode, how many blocks of the stage are like it): blocks of one
        kind, attention kind and precision under one mode save and cost the same."""
        par = self.layout.parallel
        key = ("mix", stage.index, par.recompute, par.full_recompute)
        if key not in self.memo:
            mix: dict[tuple, list] = {}
            for block in stage.blocks:
                mode = par.recompute_of(self.layer_name(block))
                like = (self.block_kinds[block], self.attention_kinds[block], block in self.fp8_blocks, mode)
                entry = mix.setdefault(like, [block, mode, 0])
                entry[2] += 1
            self.memo[key] = [tuple(entry) for entry in mix.values()]
        return self.memo[key]


def workload(layout: RunLayout, rank: int = 0) -> Workload:
    """The share of `rank` of a run's layout."""
    mesh_spec, model_cfg, split = layout.mesh, layout.model_cfg, layout.pipeline
    kinds, units_by_kind, weights_by_kind, embed, head = _tables(layout.plan, model_cfg)
    counts = split.blocks_per_stage
    pp_rank = rank // (mesh_spec.world_size // mesh_spec.pp)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    mtp = tuple(range(model_cfg.num_layers, len(kinds)))  # the MTP layer rides with the last stage
    stages = tuple(Stage(i, tuple(range(starts[i], starts[i] + counts[i])) + (mtp if i == len(counts) - 1 else ()),
                         i == 0, i == len(counts) - 1) for i in split.stage_ids(pp_rank))
    return Workload(layout=layout, pp_rank=pp_rank, stages=stages, block_kinds=kinds,
                    attention_kinds=_attention_kinds(model_cfg, len(kinds)), units_by_kind=units_by_kind,
                    weights_by_kind=weights_by_kind, embed=embed, head=head,
                    fp8_blocks=_block_indices(layout.parallel.fp8_layers))


@functools.lru_cache(maxsize=256)
def _block_indices(names: frozenset[str]) -> frozenset[int]:
    return frozenset(int(name.split(".")[1]) for name in names if name.startswith("blocks."))


@functools.lru_cache(maxsize=256)
def _attention_kinds(model_cfg, num_blocks: int) -> tuple[str, ...]:
    return tuple(layer_kind(model_cfg, i) for i in range(num_blocks))


def _tables(plan: Plan, model_cfg):
    spec_ = plan.mesh_spec
    return _unit_tables(model_cfg, spec_.tp, spec_.ep, spec_.dp_shard, spec_.cp, spec_.etp,
                        tuple((axis, mapped) for axis, mapped in plan.param_rules.items()))


@functools.lru_cache(maxsize=1024)
def _unit_tables(model_cfg, tp: int, ep: int, dp_shard: int, cp: int, etp: int | None, param_rules: tuple):
    """Every FSDP unit's element counts under a plan's parameter rules, for the sizes that shape
    them (pp and dp_replicate do not): computed once per model and split, however many searches ask."""
    mesh_spec = MeshSpec(dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp)
    plan = Plan(mesh_spec).with_rules(params=dict(param_rules))
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
    return (kinds, units_by_kind, weights_by_kind, _unit(layers[0].params, plan, mesh_spec),
            _unit(layers[-1].params, plan, mesh_spec))


@functools.lru_cache(maxsize=64)
def _layers(model_cfg) -> list[spec.Layer]:
    return families.layers(model_cfg)


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
        if is_fp8_matmul_weight(param.axes):
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
