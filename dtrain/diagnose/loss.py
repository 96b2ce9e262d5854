"""Loss: spikes against the running median, non-finite steps and what the step guard did with
them, the gradient norm's growth before them, a loss flat or rising after warm-up, and a
learning-rate schedule that does not do what its flags say; with the standard remedies as flags."""

from __future__ import annotations

import math
import statistics

from dtrain.diagnose.record import RunRecord
from dtrain.diagnose.report import Finding, Section, cap

# A loss this many times the median of the recent losses (SPIKE_WINDOW updated steps, at least
# MIN_HISTORY of them) is a spike.
SPIKE_RATIO = 1.3
SPIKE_WINDOW = 16
MIN_HISTORY = 5
# The gradient norm grew before an event when the largest of the GROWTH_STEPS norms before it is
# GROWTH_RATIO times the median of the norms before those.
GROWTH_STEPS = 5
GROWTH_RATIO = 2.0
# After warm-up, over at least TREND_STEPS updated steps: the last quarter's median loss against the first's.
TREND_STEPS = 20
RISING = 1.05
# Flat: less than FLAT below, while still above FLAT_NEAR_START x the first step's loss (nothing learnt).
FLAT = 0.01
FLAT_NEAR_START = 0.9
MAX_EVENTS = 4  # event lines shown


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def spikes(steps: list[dict]) -> list[tuple[dict, float]]:
    """(step line, its running median) of each loss spike; spikes and non-finite or skipped steps
    stay out of the median."""
    found, history = [], []
    for s in steps:
        loss = s["loss"]
        if not _finite(loss):
            continue
        recent = history[-SPIKE_WINDOW:]
        median = statistics.median(recent) if len(recent) >= MIN_HISTORY else math.nan
        if len(recent) >= MIN_HISTORY and loss > SPIKE_RATIO * median:
            found.append((s, median))
        elif not s.get("skipped"):
            history.append(loss)
    return found


def growth_before(steps: list[dict], step: int) -> float | None:
    """How many times the gradient norm grew in the GROWTH_STEPS steps before `step` against the
    median before those; None without enough history."""
    norms = [(s["step"], s["grad_norm"]) for s in steps if s["step"] < step and _finite(s["grad_norm"])]
    recent = [n for at, n in norms if at >= step - GROWTH_STEPS]
    earlier = [n for at, n in norms if at < step - GROWTH_STEPS]
    if not recent or len(earlier) < 3:
        return None
    return max(recent) / max(statistics.median(earlier), 1e-30)


def _growth_text(growth: float | None) -> str:
    if growth is None:
        return "too early to see the gradient norm grow"
    if growth >= GROWTH_RATIO:
        return f"the gradient norm grew {growth:.1f}x over the {GROWTH_STEPS} steps before"
    return "no gradient-norm growth before it (a bad batch or an overflow, not a divergence)"


def loss_section(record: RunRecord) -> Section:
    steps = record.steps
    lines, findings, events = [], [], []
    if not steps:
        return Section("loss", "Loss", ["no step logged"], findings)
    finite = [s for s in steps if _finite(s["loss"])]
    first, last = steps[0], steps[-1]
    if finite:
        norms = [s["grad_norm"] for s in finite if _finite(s["grad_norm"])]
        span = f"steps {first['step']}-{last['step']}" if last is not first else f"step {first['step']}"
        lines.append(f"{span}: loss {first['loss']:.4g} -> {last['loss']:.4g} (lowest "
                     f"{min(s['loss'] for s in finite):.4g}), median gradient norm {statistics.median(norms):.3g}")
    skip_reasons = {e["step"]: e["reason"] for e in record.journal.of_kind("skip")}
    spiked = spikes(steps)
    for s in steps:
        if _finite(s["loss"], s["grad_norm"]):
            continue
        growth = growth_before(steps, s["step"])
        did = "the guard skipped its update" if s.get("skipped") else "its update was applied"
        events.append(f"step {s['step']}: loss {s['loss']:.4g}, gradient norm {s['grad_norm']:.4g}: {did}; "
                      f"{_growth_text(growth)}")
        findings.append(Finding("loss", "nan", f"non-finite loss or gradient norm at step {s['step']}",
                                step=s["step"], flags=_remedy(record, "nan", growth)))
    for s, median in spiked:
        growth = growth_before(steps, s["step"])
        did = ("skipped by --skip-spikes" if skip_reasons.get(s["step"]) == "spike" else
               "its update was applied" + ("" if record.config.train.skip_spikes else " (--skip-spikes is off)"))
        events.append(f"step {s['step']}: loss spike {s['loss']:.4g}, {s['loss'] / median:.1f}x the running median "
                      f"{median:.4g}; {did}; {_growth_text(growth)}")
        findings.append(Finding("loss", "spike", f"loss spike at step {s['step']} ({s['loss'] / median:.1f}x the "
                                f"running median)", step=s["step"], flags=_remedy(record, "spike", growth)))
    lines += cap(events, MAX_EVENTS, "loss events")
    stopped = [f for f in record.failures if "were all skipped" in f.what]
    if stopped:
        lines.append(f"the run stopped at step {stopped[0].step}: --max-skipped-steps "
                     f"{record.config.train.max_skipped_steps} updates in a row were skipped")
    remedies = "; ".join(dict.fromkeys(f.flags for f in findings if f.flags))
    if remedies:
        lines.append(f"remedy: {remedies}")
    lines += _trend(record, findings)
    lines += _schedule(record, findings)
    return Section("loss", "Loss", lines, findings, {"spikes": [s["step"] for s, _ in spiked],
                                                     "non_finite": [f.step for f in findings if f.kind == "nan"]})


def _remedy(record: RunRecord, kind: str, growth: float | None) -> str:
    """The flags that address a spike or a non-finite step."""
    o, t = record.config.optim, record.config.train
    growing = growth is not None and growth >= GROWTH_RATIO
    flags = []
    if kind == "spike" and not t.skip_spikes:
        flags.append("--skip-spikes 3")
    if growing:  # a divergence: a smaller step size, reached more slowly
        flags += [f"--lr {o.lr / 2:g}", f"--warmup-steps {max(2 * o.warmup_steps, 1)}"]
    if o.grad_clip == 0:
        flags.append("--grad-clip 1.0")
    if kind == "nan" and t.fp8 and not growing:
        flags.append("--fp8-keep-ends (or a run without --fp8, to see whether FP8's range is the cause)")
    return " ".join(flags)


def _trend(record: RunRecord, findings: list[Finding]) -> list[str]:
    """Whether the loss falls after warm-up."""
    o = record.config.optim
    spiked = {s["step"] for s, _ in spikes(record.steps)}
    after = [s["loss"] for s in record.steps if s["step"] > o.warmup_steps and not s.get("skipped")
             and _finite(s["loss"]) and s["step"] not in spiked]
    if len(after) < TREND_STEPS:
        return []
    quarter = len(after) // 4
    early, late = statistics.median(after[:quarter]), statistics.median(after[-quarter:])
    first = next(s["loss"] for s in record.steps if _finite(s["loss"]))
    text = f"after warm-up: median loss {early:.4g} in the first quarter, {late:.4g} in the last"
    if late > RISING * early:
        findings.append(Finding("loss", "rising", f"the loss rose after warm-up ({early:.4g} -> {late:.4g})",
                                flags=f"--lr {o.lr / 2:g} --warmup-steps {max(2 * o.warmup_steps, 1)}"))
        return [f"{text}: rising; remedy: {findings[-1].flags}"]
    if late > (1 - FLAT) * early and late > FLAT_NEAR_START * first:
        findings.append(Finding("loss", "flat", f"the loss is flat after warm-up at {late:.4g}, near its start "
                                f"{first:.4g}: check the data, and --lr {o.lr:g}"))
        return [f"{text}: flat"]
    return [f"{text}: falling"]


def _schedule(record: RunRecord, findings: list[Finding]) -> list[str]:
    """Learning-rate schedule anomalies: a run that ends inside its warm-up, an LR that rises
    after warm-up (a schedule that restarted), an LR of 0 before the last step."""
    o, t = record.config.optim, record.config.train
    lines = []
    if t.steps <= o.warmup_steps:
        findings.append(Finding("loss", "lr_schedule", f"the run ends inside its warm-up (--warmup-steps "
                                f"{o.warmup_steps} of --steps {t.steps}): the LR never reaches --lr {o.lr:g}",
                                flags=f"--warmup-steps {max(1, t.steps // 10)}"))
    lrs = [(s["step"], s["lr"]) for s in record.steps if "lr" in s]
    for (_, before), (step, lr) in zip(lrs, lrs[1:]):
        if step > o.warmup_steps + 1 and lr > before * 1.001:
            findings.append(Finding("loss", "lr_schedule", f"the LR rose after warm-up at step {step} ({before:.3g} "
                                    f"-> {lr:.3g}): the schedule restarted (a resume with other --steps or --lr?)",
                                    step=step))
            break
    zero = next((step for step, lr in lrs[:-1] if lr == 0 and step > o.warmup_steps), None)
    if zero is not None:
        findings.append(Finding("loss", "lr_schedule", f"the LR is 0 from step {zero}, before the last step",
                                step=zero))
    for finding in findings:
        if finding.kind == "lr_schedule":
            lines.append(f"LR: {finding.text}" + (f"; remedy: {finding.flags}" if finding.flags else ""))
    return lines
