"""Stragglers, hangs and restarts: the ranks named, and what they cost the run."""

from __future__ import annotations

import statistics

from dtrain.diagnose.memory import OUT_OF_MEMORY
from dtrain.diagnose.record import RunRecord
from dtrain.diagnose.report import Finding, Section, cap, share
from dtrain.resilience.stragglers import RATIO_WARN

MAX_LINES = 6


def slow_ranks(checks: list[dict]) -> dict[int, dict]:
    """Per rank slower than RATIO_WARN x its stage's median in at least half of the checks (and
    two): in how many, its mean ratio, and the forward seconds above the median it took, by step."""
    slow: dict[int, dict] = {}
    for check in checks:
        seconds, stages = check["seconds"], check["stages"]
        for rank, (own, stage) in enumerate(zip(seconds, stages)):
            median = statistics.median_low([s for s, g in zip(seconds, stages) if g == stage])
            if median > 0 and own / median > RATIO_WARN:
                entry = slow.setdefault(rank, {"checks": 0, "ratios": [], "excess_s": {}})
                entry["checks"] += 1
                entry["ratios"].append(own / median)
                entry["excess_s"][check["step"]] = own - median
    return {rank: entry for rank, entry in slow.items() if entry["checks"] >= max(2, len(checks) / 2)}


def ranks_section(record: RunRecord) -> Section:
    lines, findings = [], []
    checks = record.journal.of_kind("straggler_check")
    step_s = {s["step"]: s.get("step_s") for s in record.steps}
    slow = slow_ranks(checks)
    for rank, entry in sorted(slow.items()):
        cost = [excess / step_s[at] for at, excess in entry["excess_s"].items() if step_s.get(at)]
        ratio = statistics.mean(entry["ratios"])
        costs = f", costing the job {100 * statistics.mean(cost):.0f}% of each step (its forward alone)" if cost else ""
        text = (f"rank {rank} computed {ratio:.2f}x its peers' forward time in {entry['checks']} of {len(checks)} "
                f"checks{costs}; check its GPU (nvidia-smi -q) and host")
        findings.append(Finding("ranks", "straggler", text, step=min(entry["excess_s"])))
        lines.append(text)
    if record.world_size == 1:
        lines.append("one rank: no peers to compare its speed with")
    elif checks and not slow:
        lines.append(f"{len(checks)} straggler checks: no rank stayed above {RATIO_WARN:g}x its peers")
    elif not checks:
        lines.append("no straggler check ran (--straggler-every is 0, or the run was shorter)")
    events = []
    for failure in record.failures:
        if failure.kind == "hang":
            findings.append(Finding("ranks", "hang", failure.what, step=failure.step))
            events.append(f"step {failure.step}: {failure.what[:200]}")
        elif failure.kind == "error" and OUT_OF_MEMORY not in failure.key and "were all skipped" not in failure.what:
            findings.append(Finding("ranks", "failure", failure.what, step=failure.step))
            events.append(f"step {failure.step}: {failure.what[:200]}")
        elif failure.kind == "lost" and not any(f.kind != "lost" for f in record.failures):
            findings.append(Finding("ranks", "lost", failure.what, step=failure.step))
            events.append(f"step {failure.step}: {failure.what[:200]}")
    lines += cap(events, MAX_LINES - len(lines) - 1, "failures")
    restarts = record.journal.restarts
    if restarts:
        redone = sum(max(0, r.reached - r.step) for r in restarts)
        gaps = [r.gap_s for r in restarts if r.gap_s == r.gap_s]
        mean_step = record.median("step_s") or 0.0
        lost = sum(gaps) + redone * mean_step
        elapsed = sum(s.get("step_s", 0.0) for s in record.steps) + lost
        lines.append(f"{len(restarts)} restart{'s' if len(restarts) > 1 else ''} (at step{'s' if len(restarts) > 1 else ''} "
                     f"{', '.join(str(r.step) for r in restarts)}): {redone} steps redone, about {lost:,.0f} s lost "
                     f"({share(lost, elapsed)} of the run)")
    return Section("ranks", "Stragglers, hangs and restarts", lines, findings,
                   {"slow_ranks": {str(r): e["checks"] for r, e in slow.items()}, "restarts": len(restarts)})

