"""Speed: the measured throughput against the planner's prediction for the run's layout on its
GPU, where the step goes, and the neighbouring layouts the planner predicts faster."""

from __future__ import annotations

import statistics

from dtrain.diagnose.neighbours import Neighbour, PlannerView
from dtrain.diagnose.record import RunRecord
from dtrain.diagnose.report import Finding, Section, share
from dtrain.planner.candidates import Candidate
from dtrain.planner.steptime import BOUND_NAMES

# A run this much slower than the planner predicts for its layout is named (the model's own
# error on measured runs is within 15%).
SLOWER_THAN_PREDICTED = 0.8
# Building the batches exposed for this share of the step: the data loader does not keep up.
DATA_SHARE = 0.05
# A neighbouring layout predicted at least this much faster is suggested.
MIN_GAIN = 0.05
SUGGESTIONS = 3


def exposed_data_s(step: dict) -> float:
    """The part of building a step's batches that the step waited for. On the CPU all of it; on a
    GPU the host builds them while the device still runs the previous step, so only the wall time
    the device spent idle (beyond its own time, `device_s`) could have gone to them."""
    data = step.get("data_s", 0.0)
    if "device_s" not in step:
        return data
    return min(data, max(0.0, step["step_s"] - step["device_s"]))


def speed_section(record: RunRecord, planned: PlannerView, profile: dict[str, float] | None = None) -> Section:
    lines, findings, figures = [], [], {}
    timed = record.timed_steps()
    step_s = record.median("step_s")
    if step_s is None:
        lines.append("no step was timed: the run ended before its first steps after warm-up")
        return Section("speed", "Speed", lines, findings, figures)
    tokens = record.median("tokens_per_s")
    mfu = record.median("mfu")
    first, last = timed[0]["step"], timed[-1]["step"]
    figures.update(measured_tokens_per_sec_per_gpu=tokens, measured_step_s=step_s, measured_mfu_pct=mfu)
    if record.on_gpu:
        lines.append(f"measured: {tokens:,.0f} tokens/s/GPU, {'' if mfu is None else f'MFU {mfu:.1f}%, '}"
                     f"{step_s:.3f} s per step (median of steps {first}-{last} on {record.device})")
    else:
        lines.append(f"measured on the CPU: {tokens:,.0f} tokens/s per process, {step_s:.3f} s per step "
                     f"(median of steps {first}-{last})")
    current, nearby = planned.current, planned.nearby
    if current is None:
        lines.append(f"the planner cannot evaluate this layout: {planned.error}")
    else:
        figures.update(predicted=current.as_json())
        lines.append(_against_prediction(record, current, tokens, findings))
    data_s = record.median("data_s")
    exposed = statistics.median(exposed_data_s(s) for s in timed)
    lines.append(_where(current, profile, timed, step_s, exposed))
    figures.update(data_s=data_s, exposed_data_s=exposed)
    if exposed >= DATA_SHARE * step_s:
        findings.append(Finding(
            "speed", "slow_data", f"the data loader does not keep up: the step waits {exposed * 1e3:,.1f} ms of its "
            f"{step_s * 1e3:,.1f} ms for its batches ({share(exposed, step_s)})",
            flags="--data-cache-dir LOCAL_DISK_DIR"))
        lines.append(findings[-1].text)
    if current is not None:
        lines += _suggestions(record, current, nearby, findings, figures)
    return Section("speed", "Speed", lines, findings, figures)


def _against_prediction(record: RunRecord, current: Candidate, tokens: float, findings: list[Finding]) -> str:
    predicted = current.tokens_per_sec_per_gpu
    if not record.on_gpu:
        return (f"planner: {predicted:,.0f} tokens/s/GPU for this layout on {record.gpu}, at a GPU's rates: no "
                f"yardstick for this CPU run")
    ratio = tokens / predicted
    line = (f"predicted for this layout on {record.gpu}: {predicted:,.0f} tokens/s/GPU, MFU "
            f"{100 * current.step.mfu():.1f}%; measured is {100 * ratio:.0f}% of it")
    if ratio < SLOWER_THAN_PREDICTED:
        findings.append(Finding("speed", "slower_than_predicted",
                                f"{100 * (1 - ratio):.0f}% slower than the planner predicts for this layout: the "
                                f"host (launches, data) or kernels slower than its rates take the difference"))
    return line


def _where(current: Candidate | None, profile: dict[str, float] | None, timed: list[dict], step_s: float,
           exposed: float) -> str:
    """One line: where the step's time goes, by the profile when given, else by the model; and what
    was measured: the share the step waited for its batches and, on a GPU, the share the GPU sat
    idle (the host held it up: launches, Python, data)."""
    idle = [max(0.0, s["step_s"] - s["device_s"]) for s in timed if "device_s" in s]
    measured = f"; measured: batches {share(exposed, step_s)} of the step" + (
        f", GPU idle {share(statistics.median(idle), step_s)}" if idle else "")
    if profile:
        parts = ", ".join(f"{name} {100 * value:.0f}%" for name, value in profile.items() if value >= 0.005)
        return f"where the step goes (profile): {parts}{measured}"
    if current is None:
        return f"where the step goes: unknown (no profile, no prediction){measured}"
    breakdown = current.step.breakdown()
    total = current.step.seconds
    parts = ", ".join(f"{BOUND_NAMES.get(name, name)} {share(seconds, total)}"
                      for name, seconds in sorted(breakdown.items(), key=lambda item: -item[1])
                      if seconds >= 0.005 * total)
    return f"where the step goes (planner): {parts}{measured}"


def _suggestions(record: RunRecord, current: Candidate, nearby: list[Neighbour], findings: list[Finding],
                 figures: dict) -> list[str]:
    base = current.tokens_per_sec_per_gpu
    chosen = [n for n in nearby if n.tokens_per_sec_per_gpu >= (1 + MIN_GAIN) * base][:SUGGESTIONS]
    figures["suggestions"] = [{"flags": n.flags, "group": n.group, "tokens_per_sec_per_gpu": round(n.tokens_per_sec_per_gpu, 1),
                               "gain": round(n.tokens_per_sec_per_gpu / base - 1, 4),
                               "memory_gb": round(n.candidate.memory.total / 1e9, 2)} for n in chosen]
    if not chosen:
        return [f"no neighbouring layout (one of: micro-batch, recompute, data-parallel mode, pipeline schedule, "
                f"mesh, offload) is predicted {100 * MIN_GAIN:.0f}% faster on {record.gpu}"]
    best = chosen[0]
    findings.append(Finding("speed", "layout", f"the planner predicts {best.tokens_per_sec_per_gpu / base - 1:+.0%} "
                                               f"tokens/s with {best.flags}", flags=best.flags))
    lines = [f"changes predicted faster on {record.gpu} (this layout: {base:,.0f} tokens/s/GPU), each fits:"]
    for n in chosen:
        lines.append(f"  {n.flags}: {n.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU "
                     f"({n.tokens_per_sec_per_gpu / base - 1:+.0%}, {n.candidate.memory.total / 1e9:.1f} GB)")
    return lines
