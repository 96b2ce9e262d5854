"""`--plot`: loss, gradient norm and MFU (tokens/s where MFU is not known) over the steps, with
the run's events marked, in one PNG."""

from __future__ import annotations

import math
from pathlib import Path

from dtrain.diagnose.loss import spikes
from dtrain.diagnose.ranks import slow_ranks
from dtrain.diagnose.record import RunRecord
from models.errors import UserError

# Event -> (colour, line style) of its marks.
MARKS = {"non-finite": ("red", "-"), "spike": ("orange", "-"), "straggler": ("purple", ":"),
         "restart": ("grey", "--"), "failure": ("black", "-")}


def events(record: RunRecord) -> dict[str, list[int]]:
    """The steps of each kind of event."""
    steps = record.steps
    checks = record.journal.of_kind("straggler_check")
    return {
        "non-finite": [s["step"] for s in steps if not (math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]))],
        "spike": [s["step"] for s, _ in spikes(steps)],
        "straggler": sorted({at for entry in slow_ranks(checks).values() for at in entry["excess_s"]}),
        "restart": [r.step for r in record.journal.restarts],
        "failure": [f.step for f in record.failures],
    }


def pyplot():
    """matplotlib's pyplot drawing into files, or a one-line error that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[diagnose]')") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def plot(record: RunRecord, path: Path) -> None:
    drawing = pyplot()
    steps = [s["step"] for s in record.steps]
    speed = "mfu" if any("mfu" in s for s in record.steps) else "tokens_per_s"
    panels = (("loss", "loss"), ("grad_norm", "gradient norm"),
              (speed, "MFU (%)" if speed == "mfu" else "tokens/s per GPU"))
    figure, axes = drawing.subplots(len(panels), 1, sharex=True, figsize=(10, 8))
    marked = events(record)
    for axis, (name, label) in zip(axes, panels):
        values = [s.get(name, math.nan) for s in record.steps]
        axis.plot(steps, [v if math.isfinite(v) else math.nan for v in values], linewidth=1)
        axis.set_ylabel(label)
        if name == "grad_norm" and any(v > 0 and math.isfinite(v) for v in values):
            axis.set_yscale("log")
        for kind, at in marked.items():
            colour, style = MARKS[kind]
            for index, step in enumerate(at):
                axis.axvline(step, color=colour, linestyle=style, linewidth=1, alpha=0.7,
                             label=kind if axis is axes[0] and index == 0 else None)
    axes[-1].set_xlabel("step")
    if any(marked.values()):
        axes[0].legend(loc="upper right", fontsize="small")
    axes[0].set_title(f"{record.run_dir}: {record.config.model.model}")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise UserError(f"--plot {path}: {error.strerror}; give a path this process can write") from None
    finally:
        drawing.close(figure)
