"""Memory: the measured peak against the GPU and the planner's breakdown for the run's layout;
after an out-of-memory error, the nearest layout the planner says fits, as flags."""

from __future__ import annotations

import attrs

from dtrain.config import Config
from dtrain.diagnose.neighbours import PlannerView, changed_flags
from dtrain.diagnose.record import RunRecord
from dtrain.diagnose.report import Finding, Section
from dtrain.planner import advice
from dtrain.planner.hardware import GIGA
from dtrain.planner.meshes import mesh_text
from dtrain.planner.search import nothing_fits
from models.errors import UserError

# A peak this close to the GPU's memory leaves no room for the allocator's fragmentation.
NEAR_LIMIT = 0.95
OUT_OF_MEMORY = "OutOfMemoryError"


def gb(value: float) -> str:
    """GB with the digits that tell small sizes apart: 61.2, 0.332."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def memory_section(record: RunRecord, planned: PlannerView) -> Section:
    lines, findings, figures = [], [], {}
    limit = record.gpu_memory_gb
    peaks = record.journal.series("peak_gb")
    peak = max(peaks) if peaks else None
    current = planned.current
    figures.update(peak_gb=peak, gpu_memory_gb=limit)
    if peak is not None:
        if record.on_gpu:
            lines.append(f"peak {gb(peak)} GB allocated of the GPU's {limit:g} GB ({100 * peak / limit:.0f}%)")
            if peak >= NEAR_LIMIT * limit:
                findings.append(Finding("memory", "near_limit", f"the peak is within {100 * (1 - NEAR_LIMIT):.0f}% "
                                        f"of the GPU's memory: fragmentation can fail an allocation",
                                        flags="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
                lines.append(findings[-1].text)
        else:
            lines.append(f"peak {gb(peak)} GB resident (the process's memory: this run ran on the CPU)")
    if current is None:
        lines.append(f"the planner cannot evaluate this layout: {planned.error}")
    else:
        predicted = current.memory
        figures.update(predicted_gb=predicted.as_gb())
        lines.append(f"planner, largest rank: {predicted.lines()[0].replace(' GB at', f' of {limit:g} GB at', 1)}")
    oom = [f for f in record.failures if f.kind == "error" and OUT_OF_MEMORY in f.key]
    if oom:
        lines += _after_out_of_memory(record, planned, oom[0], findings)
    return Section("memory", "Memory", lines, findings, figures)


def _as_planned(record: RunRecord) -> Config:
    """The run's configuration with its mesh written as the planner writes meshes."""
    mesh = mesh_text(record.layout.mesh)
    return attrs.evolve(record.config, parallel=attrs.evolve(record.config.parallel, mesh=mesh))


def _after_out_of_memory(record: RunRecord, planned: PlannerView, failure, findings: list[Finding]) -> list[str]:
    limit = record.gpu_memory_gb
    what = failure.what.split(": ", 1)[-1]
    lines = [f"rank {failure.rank} ran out of memory at step {failure.step} ({failure.phase}): {what[:100]}"]
    current = planned.current
    if current is not None:
        total = current.memory.total / GIGA
        if total > limit:
            lines.append(f"the planner predicts {gb(total)} GB for this layout: more than the {limit:g} GB it had")
        else:
            lines.append(f"the planner predicts {gb(total)} GB, within the {limit:g} GB: the rest is outside its model "
                         f"(fragmentation, another process on the GPU, the data's longest sample)")
    try:
        nearest = advice.nearest_fit(record.layout, record.target)
    except UserError as error:
        nearest, why = None, str(error)
    else:
        why = nothing_fits(record.target) if nearest is None else ""
    if nearest is None:
        findings.append(Finding("memory", "out_of_memory", f"out of memory; {why}", step=failure.step))
        return lines + [why]
    flags = changed_flags(current.config if current is not None else _as_planned(record), nearest.config)
    if not flags:
        findings.append(Finding("memory", "out_of_memory", f"out of memory on rank {failure.rank}, in a layout the "
                                f"planner predicts fits", step=failure.step,
                                flags="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
        return lines + [f"the planner knows no layout nearer than this one; remedy: {findings[-1].flags}"]
    findings.append(Finding("memory", "out_of_memory", f"out of memory on rank {failure.rank}; the nearest layout "
                            f"that fits: {flags}", step=failure.step, flags=flags))
    lines.append(f"nearest layout that fits: {flags} ({gb(nearest.memory.total / GIGA)} GB, "
                 f"{nearest.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU predicted on {record.gpu})")
    return lines
