"""`--print-plan`: the sharding plan of a configuration and the predicted memory per rank,
printed without training."""

from __future__ import annotations

from dtrain import distributed
from dtrain.config import Config
from dtrain.plan import advice, memory
from dtrain.plan.validate import build_plan, validate, with_global_batch
from models import families
from parallel.mesh import MeshSpec


def print_plan(config: Config) -> None:
    """The plan for the mesh as given; without torchrun the world is what the mesh names."""
    world_size = distributed.world_size_from_env() if distributed.launched_by_torchrun() else None
    if config.parallel.mesh == "auto":
        config = advice.choose(config, world_size or 1)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    config = with_global_batch(config, mesh_spec.world_size)
    _, model_cfg = validate(config, mesh_spec.world_size)
    plan = build_plan(config, mesh_spec, model_cfg)
    print(plan.describe(families.layers(model_cfg)))
    print("\n".join(memory_lines(config, mesh_spec)))


def memory_lines(config: Config, mesh_spec: MeshSpec) -> list[str]:
    """The predicted peak GPU memory of each pipeline stage's ranks (every rank of a stage holds
    the same), as python -m dtrain.plan predicts it for H200-class GPUs."""
    per_stage = mesh_spec.world_size // mesh_spec.pp
    lines = ["memory per rank (predicted peak, by category in GB):"]
    for pp_rank in range(mesh_spec.pp):
        first = pp_rank * per_stage
        ranks = f"ranks {first}-{first + per_stage - 1}" if per_stage > 1 else f"rank {first}"
        label = f"pp rank {pp_rank} ({ranks})" if mesh_spec.pp > 1 else ranks
        lines.append(f"  {label}: {memory.predict(config, mesh_spec.world_size, first).lines()[0]}")
    return lines
