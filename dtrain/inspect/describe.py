"""`--print-plan`: the sharding plan of a configuration, its pipeline stages and the predicted
memory per rank, printed without training."""

from __future__ import annotations

from dtrain import distributed, rank_model
from dtrain.config import Config
from dtrain.planner import advice, memory
from dtrain.layout.checks import build_plan, validate, with_global_batch
from models import families, flops
from models.presets import get_model_config
from parallel import pipeline
from parallel.mesh import MeshSpec


def planned_world_size(config: Config) -> int | None:
    """`--world-size`, else torchrun's; None: the product of the mesh sizes."""
    if config.parallel.world_size is not None:
        return config.parallel.world_size
    return distributed.world_size_from_env() if distributed.launched_by_torchrun() else None


def print_plan(config: Config) -> None:
    """The plan for the mesh as given (`--mesh auto`: the planner's choice for the world)."""
    world_size = planned_world_size(config)
    if config.parallel.mesh == "auto":
        config = advice.choose(config, world_size or 1)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    config = with_global_batch(config, mesh_spec.world_size)
    _, model_cfg = validate(config, mesh_spec.world_size)
    plan = build_plan(config, mesh_spec, model_cfg)
    print(plan.describe(families.layers(model_cfg)))
    if mesh_spec.pp > 1:
        print(describe_stages(config, mesh_spec, rank_model.blocks_per_stage(config, model_cfg, mesh_spec)))
    print("\n".join(memory_lines(config, mesh_spec)))


def stage_text(blocks_per_stage: list[int], stage: int, mtp_depth: int = 0) -> str:
    """`embedding + blocks 0-9`, `blocks 10-19`, `blocks 71-79 + head` (`+ MTP + head` where the
    model has multi-token prediction, which runs on the last stage)."""
    first = sum(blocks_per_stage[:stage])
    last = first + blocks_per_stage[stage] - 1
    parts = ["embedding"] if stage == 0 else []
    parts.append(f"block {first}" if first == last else f"blocks {first}-{last}")
    if stage == len(blocks_per_stage) - 1:
        parts += [*(["MTP" if mtp_depth == 1 else f"{mtp_depth} MTP modules"] if mtp_depth else []), "head"]
    return " + ".join(parts)


def mtp_depth(config: Config) -> int:
    """The model's multi-token prediction modules (0 without)."""
    return flops.mtp_depth(get_model_config(config.model.model, config.model.model_overrides))


def describe_stages(config: Config, mesh_spec: MeshSpec, blocks_per_stage: list[int]) -> str:
    """A table of the pipeline stages: blocks, layers, and the ranks that hold each."""
    p = config.parallel
    ranks_of_pp_rank: dict[int, list[int]] = {}
    for rank in range(mesh_spec.world_size):
        ranks_of_pp_rank.setdefault(mesh_spec.coordinates(rank)["pp"], []).append(rank)
    pp_rank_of_stage = {stage: pp_rank for pp_rank in range(mesh_spec.pp)
                        for stage in pipeline.stage_ids(pp_rank, mesh_spec.pp, p.pp_virtual_stages, p.pp_schedule)}
    m = rank_model.num_microbatches(config, mesh_spec)
    rows = [("stage", "blocks", "layers", "pp rank", "ranks")]
    depth = mtp_depth(config)
    for stage, count in enumerate(blocks_per_stage):
        pp_rank = pp_rank_of_stage[stage]
        rows.append((str(stage), str(count), stage_text(blocks_per_stage, stage, depth), str(pp_rank),
                     rank_ranges(tuple(ranks_of_pp_rank[pp_rank]))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"pipeline: {p.pp_schedule}, {len(blocks_per_stage)} stages ({mesh_spec.pp} ranks x "
             f"{p.pp_virtual_stages} per rank), {m} micro-batches per step on each data-parallel rank"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def rank_ranges(ranks: tuple[int, ...]) -> str:
    """`0-7,64-71` for runs of consecutive ranks."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def memory_lines(config: Config, mesh_spec: MeshSpec) -> list[str]:
    """The predicted peak GPU memory of each pipeline stage's ranks (every rank of a stage holds
    the same), as python -m dtrain.planner predicts it for H200-class GPUs."""
    ranks_of_pp_rank: dict[int, list[int]] = {}
    for rank in range(mesh_spec.world_size):
        ranks_of_pp_rank.setdefault(mesh_spec.coordinates(rank)["pp"], []).append(rank)
    lines = ["memory per rank (predicted peak, by category in GB):"]
    for pp_rank, ranks in sorted(ranks_of_pp_rank.items()):
        held_by = f"{'ranks' if len(ranks) > 1 else 'rank'} {rank_ranges(tuple(ranks))}"
        label = f"pp rank {pp_rank} ({held_by})" if mesh_spec.pp > 1 else held_by
        lines.append(f"  {label}: {memory.predict(config, mesh_spec.world_size, ranks[0]).lines()[0]}")
    return lines
