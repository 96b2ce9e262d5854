"""`--print-plan`: the sharding plan of a configuration and its pipeline stages, printed without
training."""

from __future__ import annotations

from dtrain import build, distributed
from dtrain.config import Config
from dtrain.plan.validate import build_plan, validate, with_global_batch
from models import families
from parallel import pipeline
from parallel.mesh import MeshSpec


def planned_world_size(config: Config) -> int | None:
    """`--world-size`, else torchrun's; None: the product of the mesh sizes."""
    if config.parallel.world_size is not None:
        return config.parallel.world_size
    return distributed.world_size_from_env() if distributed.launched_by_torchrun() else None


def print_plan(config: Config) -> None:
    mesh_spec = MeshSpec.parse(config.parallel.mesh, planned_world_size(config))
    config = with_global_batch(config, mesh_spec.world_size)
    _, model_cfg = validate(config, mesh_spec.world_size)
    plan = build_plan(config, mesh_spec, model_cfg)
    print(plan.describe(families.layers(model_cfg)))
    if mesh_spec.pp > 1:
        print(describe_stages(config, mesh_spec, build.blocks_per_stage(config, model_cfg, mesh_spec)))


def stage_text(blocks_per_stage: list[int], stage: int) -> str:
    """`embedding + blocks 0-9`, `blocks 10-19`, `blocks 71-79 + head`."""
    first = sum(blocks_per_stage[:stage])
    last = first + blocks_per_stage[stage] - 1
    parts = ["embedding"] if stage == 0 else []
    parts.append(f"block {first}" if first == last else f"blocks {first}-{last}")
    if stage == len(blocks_per_stage) - 1:
        parts.append("head")
    return " + ".join(parts)


def describe_stages(config: Config, mesh_spec: MeshSpec, blocks_per_stage: list[int]) -> str:
    """A table of the pipeline stages: blocks, layers, and the ranks that hold each."""
    p = config.parallel
    ranks_of_pp_rank: dict[int, list[int]] = {}
    for rank in range(mesh_spec.world_size):
        ranks_of_pp_rank.setdefault(mesh_spec.coordinates(rank)["pp"], []).append(rank)
    pp_rank_of_stage = {stage: pp_rank for pp_rank in range(mesh_spec.pp)
                        for stage in pipeline.stage_ids(pp_rank, mesh_spec.pp, p.pp_virtual_stages, p.pp_schedule)}
    m = build.num_microbatches(config, mesh_spec)
    rows = [("stage", "blocks", "layers", "pp rank", "ranks")]
    for stage, count in enumerate(blocks_per_stage):
        pp_rank = pp_rank_of_stage[stage]
        rows.append((str(stage), str(count), stage_text(blocks_per_stage, stage), str(pp_rank),
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
