"""`--print-plan`: the sharding plan of a configuration, printed without training."""

from __future__ import annotations

from dtrain import distributed
from dtrain.config import Config
from dtrain.plan.validate import build_plan, validate, with_global_batch
from models import families
from parallel.mesh import MeshSpec


def print_plan(config: Config) -> None:
    """The plan for the mesh as given; without torchrun the world is what the mesh names."""
    world_size = distributed.world_size_from_env() if distributed.launched_by_torchrun() else None
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    config = with_global_batch(config, mesh_spec.world_size)
    _, model_cfg = validate(config, mesh_spec.world_size)
    plan = build_plan(config, mesh_spec, model_cfg)
    print(plan.describe(families.layers(model_cfg)))
