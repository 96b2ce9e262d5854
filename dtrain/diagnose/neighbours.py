"""The layouts next to a run's: the planner's search with all of the run's choices fixed but one
group of them (the micro-batch, recompute, both, the data-parallel mode, the pipeline schedule,
the mesh, CPU offload), the fastest that fit first, each as the flags that change.

    current, nearby = neighbours(layout, target)
    nearby[0].flags, nearby[0].candidate.tokens_per_sec_per_gpu
"""

from __future__ import annotations

import attrs

from dtrain.config import Config
from dtrain.diagnose.record import RunRecord
from dtrain.layout import RunLayout
from dtrain.planner.candidates import Candidate, Fixed, Target
from dtrain.planner.meshes import mesh_text
from dtrain.planner.search import search
from models.errors import UserError
from parallel.mesh import MESH_KEYS, MeshSpec

# Each group of Fixed's fields that one change frees (the micro-batch and recompute trade memory
# for each other, so they are also freed together).
GROUPS = {
    "micro-batch": ("micro_batch",),
    "recompute": ("recompute", "recompute_layers"),
    "micro-batch and recompute": ("micro_batch", "recompute", "recompute_layers"),
    "data-parallel mode": ("dp_mode", "fsdp_reshard_after_forward"),
    "pipeline schedule": ("pp_schedule", "pp_virtual_stages"),
    "mesh": ("mesh",),
    "CPU offload": ("cpu_offload",),
}
# A neighbouring mesh moves ranks between at most this many of the mesh's dims.
MESH_DIMS_CHANGED = 2


@attrs.frozen
class PlannerView:
    """The planner's view of a run's layout and of its faster neighbours, or why it has none."""

    current: Candidate | None
    nearby: list
    error: str = ""


@attrs.frozen
class Neighbour:
    group: str
    candidate: Candidate
    flags: str  # the dtrain.run flags that turn the run's layout into this one

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.candidate.tokens_per_sec_per_gpu


def changed_flags(before: Config, after: Config) -> str:
    """The flags that turn layout `before` into `after` (`--micro-batch 4 --recompute none`)."""
    b, a = before, after
    flags = []
    for flag, old, new in (
            ("--mesh", b.parallel.mesh, a.parallel.mesh),
            ("--micro-batch", b.data.micro_batch, a.data.micro_batch),
            ("--recompute", b.train.recompute, a.train.recompute),
            ("--recompute-layers", b.train.recompute_layers, a.train.recompute_layers),
            ("--pp-schedule", b.parallel.pp_schedule, a.parallel.pp_schedule),
            ("--pp-virtual-stages", b.parallel.pp_virtual_stages, a.parallel.pp_virtual_stages),
            ("--dp-mode", b.parallel.dp_mode, a.parallel.dp_mode),
            ("--fsdp-reshard-after-forward", b.parallel.fsdp_reshard_after_forward,
             a.parallel.fsdp_reshard_after_forward)):
        if old != new:
            flags.append(f"{flag} {new}")
    for flag, old, new in (("cpu-offload", b.parallel.cpu_offload, a.parallel.cpu_offload),
                           ("sequence-parallel", b.parallel.sequence_parallel, a.parallel.sequence_parallel)):
        if old != new:
            flags.append(f"--{'' if new else 'no-'}{flag}")
    return " ".join(flags)


def _near_mesh(candidate: Candidate, mesh: MeshSpec) -> bool:
    theirs = candidate.layout.mesh
    return sum(getattr(theirs, key) != getattr(mesh, key) for key in MESH_KEYS) <= MESH_DIMS_CHANGED


def fixed_of(layout: RunLayout) -> Fixed:
    """Every layout choice of `layout` fixed: the planner's search answers this layout alone."""
    c = layout.config
    p, t = c.parallel, c.train
    return Fixed(mesh=mesh_text(layout.mesh), micro_batch=c.data.micro_batch, recompute=t.recompute,
                 recompute_layers=t.recompute_layers, pp_schedule=p.pp_schedule, pp_virtual_stages=p.pp_virtual_stages,
                 fsdp_reshard_after_forward=p.fsdp_reshard_after_forward, cpu_offload=p.cpu_offload, dp_mode=p.dp_mode)


def neighbours(layout: RunLayout, target: Target) -> tuple[Candidate, list[Neighbour]]:
    """The planner's view of the run's layout, and per group the fastest neighbour that fits,
    fastest first (only those the planner predicts faster than the run's layout)."""
    fixed = fixed_of(layout)
    current = search(attrs.evolve(target, fixed=fixed))[0]
    mesh = layout.mesh
    found: dict[str, Neighbour] = {}
    for group, fields in GROUPS.items():
        freed = attrs.evolve(fixed, **dict.fromkeys(fields))
        try:
            candidates = search(attrs.evolve(target, fixed=freed))
        except UserError:
            continue
        # The group's fastest change (candidates come fastest first), unless another group has it.
        best = next((c for c in candidates if c.fits and _near_mesh(c, mesh)
                     and changed_flags(current.config, c.config)), None)
        if best is None or best.tokens_per_sec_per_gpu <= current.tokens_per_sec_per_gpu:
            continue
        flags = changed_flags(current.config, best.config)
        if all(n.flags != flags for n in found.values()):
            found[group] = Neighbour(group, best, flags)
    return current, sorted(found.values(), key=lambda n: -n.tokens_per_sec_per_gpu)


def planner_view(record: RunRecord) -> PlannerView:
    """The planner's view of a recorded run on the GPUs it ran on."""
    try:
        return PlannerView(*neighbours(record.layout, record.target))
    except UserError as error:
        return PlannerView(None, [], str(error))
