"""The meshes the planner considers for a target: every split of the GPUs into tp (within a
node), cp, pp with its schedule and virtual stages, dp_shard and dp_replicate, and for MoE
models ep, which borrows its ranks from dp_shard x cp (inside a node or across nodes), each
resolved as a run of it would be (dtrain.layout.resolve: a mesh the run would refuse is no
candidate) with the workloads of its first and last pipeline rank; or only the target's fixed mesh."""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from dtrain.config import Config, DataArgs, ModelArgs, ParallelArgs, TrainArgs
from dtrain.layout import RunLayout, resolve
from dtrain.planner.candidates import Target
from dtrain.planner.workload import Workload, workload
from models.config import MoEConfig
from models.presets import get_model_config
from models.errors import UserError
from parallel.mesh import MeshSpec

# Virtual stages per rank the interleaved schedule is tried with (where pp x v stages have a
# block each). Published layouts use 2 to 14.
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
# HSDP replica counts tried besides none and plain DDP: powers of two that leave >= 8 shards.
REPLICAS = (2, 4, 8, 16, 32, 64, 128)


@attrs.frozen
class MeshBase:
    """One mesh and pipeline schedule, resolved with a micro-batch of 1 and no recompute (the
    search varies those: `dtrain.layout.with_choices`), and the workloads of its first and last
    pipeline rank."""

    layout: RunLayout
    works: tuple[Workload, ...]

    @property
    def config(self) -> Config:
        return self.layout.config

    @property
    def spec(self) -> MeshSpec:
        return self.layout.mesh

    @property
    def pp(self) -> int:
        return self.spec.pp

    @property
    def dp(self) -> int:
        return self.spec.dp_size

    @property
    def fsdp_ranks(self) -> int:
        return self.spec.dp_shard * self.spec.cp


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [k for k in range(1, (limit or n) + 1) if n % k == 0]


def mesh_bases(target: Target, refusals: list[UserError] | None = None) -> Iterator[MeshBase]:
    """Each mesh's base; `refusals` collects why the meshes that a run would refuse were left out."""
    cfg = get_model_config(target.model, target.model_overrides)
    if target.fixed.mesh:
        # The fixed mesh as a run resolves it (its errors are the user's), for its sizes.
        specs = [resolve(_config(target, target.fixed.mesh, "1f1b", 1, False), target.gpus, target.machine).mesh]
    else:
        specs = _mesh_specs(target, cfg)
    for spec in specs:
        for schedule, virtual in _schedules(target, spec.pp, cfg.num_layers):
            base = _base(target, spec, schedule, virtual, strict=target.fixed.mesh is not None, refusals=refusals)
            if base is not None:
                yield base


def _mesh_specs(target: Target, cfg) -> Iterator[MeshSpec]:
    is_moe = isinstance(cfg, MoEConfig)
    gpus, seq = target.gpus, target.seq_len
    for tp in divisors(gpus, min(gpus, target.gpus_per_node)):
        if cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads) or (is_moe and seq % tp):
            continue
        for cp in divisors(gpus // tp):
            if cp > 1 and (seq % (2 * cp) or seq // cp < 1024):
                continue
            for pp in divisors(gpus // (tp * cp), min(cfg.num_layers, gpus // (tp * cp))):
                dp = gpus // (tp * cp * pp)
                if target.global_batch % dp:
                    continue
                for dp_replicate in replicas(dp):
                    dp_shard = dp // dp_replicate
                    for ep in (divisors(cfg.num_experts) if is_moe else [1]):
                        sizes = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
                        if (dp_shard * cp) % ep == 0:
                            yield MeshSpec(**sizes)
                        if ep > 1 and tp > 1 and (dp_shard * cp * tp) % ep == 0:
                            yield MeshSpec(**sizes, etp=1)  # the experts folding tp's ranks in


def replicas(dp: int) -> list[int]:
    """dp_replicate sizes worth trying: none, HSDP with >= 8 shards, and plain DDP (all replicas)."""
    return sorted({1, dp} | {r for r in REPLICAS if dp % r == 0 and dp // r >= 8})


def _schedules(target: Target, pp: int, num_layers: int) -> list[tuple[str, int]]:
    fixed = target.fixed
    if pp == 1:
        return [(fixed.pp_schedule or "1f1b", fixed.pp_virtual_stages or 1)]
    if fixed.pp_schedule is not None or fixed.pp_virtual_stages is not None:
        virtual = fixed.pp_virtual_stages or (1 if fixed.pp_schedule in (None, "1f1b", "gpipe") else 2)
        schedule = fixed.pp_schedule or ("1f1b" if virtual == 1 else "interleaved-1f1b")
        return [(schedule, virtual)]
    return [("1f1b", 1)] + [("interleaved-1f1b", v) for v in VIRTUAL_STAGES if pp * v <= num_layers]


def mesh_text(spec: MeshSpec) -> str:
    sizes = {"pp": spec.pp, "dp_replicate": spec.dp_replicate, "dp_shard": spec.dp_shard, "cp": spec.cp,
             "tp": spec.tp, "ep": spec.ep}
    folded = ",etp=1" if spec.experts_fold_tp and spec.ep > 1 else ""
    return (",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "dp_shard=1") + folded


def _config(target: Target, mesh: str, schedule: str, virtual: int, sequence_parallel: bool) -> Config:
    return Config(
        model=ModelArgs(target.model, target.model_overrides),
        parallel=ParallelArgs(mesh=mesh, sequence_parallel=sequence_parallel, pp_schedule=schedule,
                              pp_virtual_stages=virtual),
        data=DataArgs(data="synthetic", seq_len=target.seq_len, micro_batch=1, global_batch=target.global_batch),
        train=TrainArgs(compile=target.compile, fp8=target.fp8, fp8_backend=target.fp8_backend,
                        fp8_head=target.fp8_head, fp8_experts=target.fp8_experts, precision=target.precision,
                        loss_chunk_tokens=target.loss_chunk_tokens),
    )


def _base(target: Target, spec: MeshSpec, schedule: str, virtual: int, strict: bool,
          refusals: list[UserError] | None) -> MeshBase | None:
    """The mesh's base, or None where a run would refuse it (`strict`: the error)."""
    config = _config(target, target.fixed.mesh or mesh_text(spec), schedule, virtual, sequence_parallel=spec.tp > 1)
    try:
        layout = resolve(config, target.gpus, target.machine)
    except UserError as refusal:
        if strict:
            raise
        if refusals is not None:
            refusals.append(refusal)
        return None
    # Under pp the last stage (the head) may hold the most; else the first rank does (an uneven
    # shard leaves the last ranks less).
    ranks = (0, target.gpus - 1) if spec.pp > 1 else (0,)
    return MeshBase(layout, tuple(workload(layout, rank) for rank in ranks))
