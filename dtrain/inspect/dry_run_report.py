"""What `--dry-run` measures of one program's step (`ProgramReport`, one `StageCost` per stage
of a pipelined rank) and the text it prints of it: the run's header, and for each role of rank its
parameters, gradients and optimizer state, its peak memory and what makes it up, the memory model's
figure beside it, and its collectives per step."""

from __future__ import annotations

from collections import defaultdict

import attrs

from dtrain.inspect.accounting import CollectiveTally
from dtrain.inspect.describe import assumptions_line, does_not_fit, rank_ranges, stage_text
from dtrain.inspect.roles import Role
from dtrain.layout import RunLayout
from dtrain.planner import memory
from models import flops
from parallel.mesh import FSDP_SHARD_DIM, MESH_DIMS


@attrs.define
class StageCost:
    """One micro-batch through one of the rank's stages, in steady state."""

    activation_bytes: int  # what its forward keeps for the backward
    backward_extra_bytes: int  # the backward's working memory beyond those activations
    input_bytes: int  # the activation received from the previous stage (0 on the first)
    output_bytes: int  # the activation sent to the next stage (0 on the last)


@attrs.define
class ProgramReport:
    """One program's step, measured on its first rank."""

    rank: int
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    kept_bytes: int = 0  # live through the micro-batches: parameters, gathered parameters, gradients
    phase_peaks: dict[str, int] = attrs.field(factory=dict)  # the peak of each phase as it ran
    stages: list[StageCost] = attrs.field(factory=list)
    collectives: dict = attrs.field(factory=lambda: defaultdict(CollectiveTally))
    # pipelined: pp rank -> the micro-batches each stage holds after each step of the schedule
    held: dict[int, list[dict[int, int]]] = attrs.field(factory=dict)


def bytes_text(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def header_text(layout: RunLayout, roles: list[Role]) -> str:
    config, mesh_spec, world_size, m = layout.config, layout.mesh, layout.world_size, layout.num_microbatches
    d, p, counts = config.data, config.parallel, list(layout.pipeline.blocks_per_stage)
    lines = [f"dry run: {config.model.model} on {world_size} ranks, mesh {mesh_spec}, seq {d.seq_len}, "
             f"micro-batch {d.micro_batch}, global batch {d.global_batch} ({m} micro-batches per step per "
             f"data-parallel rank), {config.train.precision}, recompute {config.train.recompute}"
             + (f" + full on {config.train.recompute_layers} blocks per stage" if config.train.recompute_layers else "")
             + (", CPU offload" if layout.parallel.fsdp.cpu_offload else "")]
    if mesh_spec.pp > 1:
        lines.append(f"pipeline: {p.pp_schedule}, {len(counts)} stages, blocks per stage {counts}")
    lines.append(assumptions_line(layout))
    lines.append(f"{len(roles)} role(s) of rank: ranks that differ only in their data-parallel coordinate (or in "
                 f"their tp, cp or ep coordinate where every split is even) run the same program")
    return "\n".join(lines)


def peak_of_role(report: ProgramReport, role: Role, offload_bytes: int = 0) -> tuple[int, str]:
    """The role's peak bytes on its device, and what makes it up. Under CPU offload the
    parameters, gradients and optimizer state (`offload_bytes`) are host memory, and so are the
    initialization and the optimizer step."""
    peaks = dict(report.phase_peaks)
    if offload_bytes:
        peaks = {phase: peak - offload_bytes for phase, peak in peaks.items()
                 if phase not in ("initialization", "optimizer step")}
    kept = report.kept_bytes - offload_bytes
    why = ""
    if role.pp_rank in report.held:
        cost = {stage_id: report.stages[i] for i, stage_id in enumerate(role.stage_ids)}
        held, fullest = max((sum(n * cost[s].activation_bytes for s, n in point.items()), sorted(point.items()))
                            for point in report.held[role.pp_rank])
        extra = max(c.backward_extra_bytes for c in report.stages)
        in_flight = " + ".join(f"{n} micro-batch{'es' * (n != 1)} on stage {s}" for s, n in fullest if n)
        peaks["micro-batches"] = max(peaks.get("micro-batches", 0), kept + held + extra)
        why = (f": {bytes_text(kept)} kept through the step + {bytes_text(held)} of activations ({in_flight}) "
               f"+ {bytes_text(extra)} backward working memory")
    phase = max(peaks, key=peaks.get)
    return peaks[phase], f"in the {phase}{why if phase == 'micro-batches' else ''}"


_DIM_ORDER = {dim: i for i, dim in enumerate((*MESH_DIMS, FSDP_SHARD_DIM, "edp", "ep", "world", "other"))}


def role_text(layout: RunLayout, role: Role, report: ProgramReport) -> str:
    config, mesh_spec, counts = layout.config, layout.mesh, list(layout.pipeline.blocks_per_stage)
    where = ""
    if mesh_spec.pp > 1:
        depth = flops.mtp_depth(layout.model_cfg)
        where = " | pp rank {}: ".format(role.pp_rank) + ", ".join(
            f"stage {s} ({stage_text(counts, s, depth)})" for s in role.stage_ids)
    offload = report.param_bytes + report.grad_bytes + report.optimizer_bytes if layout.parallel.fsdp.cpu_offload else 0
    peak, why = peak_of_role(report, role, offload)
    lines = [
        f"ranks {rank_ranges(role.ranks)}{where} (run as rank {report.rank})",
        f"  parameters {bytes_text(report.param_bytes)}, gradients {bytes_text(report.grad_bytes)}, "
        f"optimizer state {bytes_text(report.optimizer_bytes)}" + (" (in host memory)" if offload else ""),
        f"  peak memory, measured by this dry run: {bytes_text(peak)} {why}{does_not_fit(peak, layout)}",
        # The memory model's figure beside the measured one: the planner ranks layouts by it, and
        # --print-plan prints it; the two differ by what the model leaves out or rounds.
        f"  peak memory, predicted by the planner's memory model (--print-plan): "
        f"{memory.predict(layout, report.rank).lines()[0]}",
        "  collectives per step: mesh dim, kind, count, bytes",
    ]
    for (dim, kind), tally in sorted(report.collectives.items(), key=lambda kv: (_DIM_ORDER[kv[0][0]], kv[0][1])):
        lines.append(f"    {dim:<12} {kind:<15} {tally.count:>7,} {bytes_text(tally.bytes):>11}")
    return "\n".join(lines)
