"""Which ranks of a world run the same program, found from the mesh and the pipeline split alone.

A rank's program is fixed by the layers of its pipeline stages and the shape of every shard it
holds: ranks that differ only in their data-parallel coordinate run the same one, and so do tp,
cp and ep ranks, unless a split is uneven and the last ranks hold less. Two pipeline ranks whose
stages have the same layers also run the same program; only their place in the schedule, how
many micro-batches they hold at once, differs. So a 128-rank llama3-70b on tp=8,pp=8,cp=2 has
8 roles (one per pipeline rank) and 4 programs (first stage, last stage, and the middle stages
of 10 and of 11 blocks).
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from models import families, spec
from models.config import LlamaConfig
from parallel import pipeline
from parallel.mesh import MeshSpec
from parallel.plan import Plan


@attrs.frozen
class Role:
    """Ranks that run one program at one place in the pipeline schedule."""

    ranks: tuple[int, ...]
    pp_rank: int
    stage_ids: tuple[int, ...]
    program: Hashable  # equal for ranks that run the same program

    @property
    def first_rank(self) -> int:
        return self.ranks[0]


def find_roles(plan: Plan, model_cfg: LlamaConfig, blocks_per_stage: list[int], *, schedule: str, virtual: int,
               seq_len: int, layer_flags=lambda name: ()) -> list[Role]:
    """Every rank of the world grouped into roles, in rank order of their first rank.
    `layer_flags(name)` adds what else sets a layer apart (FP8, full recompute)."""
    mesh_spec: MeshSpec = plan.mesh_spec
    layers = families.layers(model_cfg)
    pp = mesh_spec.pp
    stage_layers = ({i: pipeline.stage_layers(layers, blocks_per_stage, i) for i in range(len(blocks_per_stage))}
                    if pp > 1 else {0: layers})
    shapes: dict = {}  # (the layer's parameter specs, coordinates) -> their shard shapes

    def layer_key(layer: spec.Layer, at: dict[str, int]) -> Hashable:
        params = tuple((p.shape, p.axes) for _, p in spec.flatten(layer.params))
        where = tuple(sorted((dim, i) for dim, i in at.items() if dim != "pp"))
        if (params, where) not in shapes:
            shapes[params, where] = tuple(plan.local_shape(shape, axes, at) for shape, axes in params)
        return layer.name.split(".")[0], layer_flags(layer.name), shapes[params, where]

    by_key: dict[Hashable, list[int]] = {}
    details: dict[Hashable, tuple[int, tuple[int, ...], Hashable]] = {}
    for rank in range(mesh_spec.world_size):
        at = mesh_spec.coordinates(rank)
        ids = tuple(pipeline.stage_ids(at["pp"], pp, virtual, schedule)) if pp > 1 else (0,)
        # Sequence parallelism splits each cp rank's tokens over tp, unevenly where they do not divide.
        local_seq = seq_len // mesh_spec.cp
        chunk = -(-local_seq // mesh_spec.tp)
        seq_shard = max(0, min(chunk, local_seq - chunk * at["tp"])) if plan.sequence_parallel else local_seq
        program = tuple(tuple(layer_key(layer, at) for layer in stage_layers[i]) for i in ids) + (seq_shard,)
        key = (at["pp"], program)
        by_key.setdefault(key, []).append(rank)
        details[key] = (at["pp"], ids, program)
    return [Role(tuple(ranks), *details[key]) for key, ranks in by_key.items()]
