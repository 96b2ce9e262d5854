"""The README's FP8 tables, rendered from what the tools recorded (`python -m tools.bench --table
benchmarks/results.jsonl --readme README.md` writes both where the README has their markers):

- `recipes_table`: every setup measured with Transformer Engine, beside the same setup in bf16 and
  with torchao: the newest run of each precision, tokens/s/GPU and MFU, and each TE run's speed over
  torchao's tensorwise run of the same setup in the same call of tools.bench_suite (the row's
  `call`; the only fair ratio: the same machine, where runs of different calls differ by several
  percent with nothing changed). A TE run with no torchao run in its call shows no ratio.
- `curves_table`: the loss curves that `python -m tools.te_check --phase curves` records
  (`benchmarks/fp8_curves.json`), as window means against the first curve's (bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.data.packed import write_atomic
from dtrain.planner.measured import flag_value, gpu_name, read_rows, run_options
from models.errors import UserError

# Flags that choose the precision of a run, and those that say what it puts in FP8 besides the blocks.
PRECISION_FLAGS = ("--fp8", "--fp8-backend")
EXTENT_FLAGS = {"--fp8-head": "head", "--fp8-experts": "experts"}
RECIPE_ORDER = ("bf16", "torchao tensorwise", "torchao rowwise", "te delayed", "te current", "te blockwise", "te mxfp8")
CURVES_FILE = "fp8_curves.json"


def recipe(row: dict) -> str:
    """'bf16', or the FP8 backend and recipe of a benchmark row ('torchao tensorwise', 'te delayed')."""
    fp8 = flag_value(row["args"], "--fp8")
    return "bf16" if fp8 is None else f"{flag_value(row['args'], '--fp8-backend', 'torchao')} {fp8}"


def extent(row: dict) -> str:
    """What a row's run put in FP8: the blocks' linears, and the head and routed experts where flagged."""
    return ", ".join(["blocks", *(what for flag, what in EXTENT_FLAGS.items() if flag in row["args"])])


def _setup(row: dict) -> tuple:
    options = run_options(row, ("--mesh", "--run-dir", *PRECISION_FLAGS, *EXTENT_FLAGS))
    return (row["shape"], row["gpus"], row["device"], row["mesh"], row["seq_len"], row["micro_batch"],
            row["global_batch"], *options)


def recipes_table(path: Path) -> str:
    # Each GPU row with its setup, extent and recipe, in file (time) order.
    rows = [(_setup(r), extent(r), recipe(r), r) for r in read_rows(path) if r.get("device", "cpu") != "cpu"]
    with_te = {setup for setup, _, name, _ in rows if name.startswith("te ")}
    newest: dict[tuple, dict] = {}  # (setup, extent or "" for bf16, recipe) -> its newest row
    torchao: dict[tuple, dict] = {}  # (setup, extent, call) -> torchao's tensorwise run of that call
    for setup, what, name, r in rows:
        if setup in with_te:
            newest[(setup, "" if name == "bf16" else what, name)] = r
            if name == "torchao tensorwise" and r.get("call"):
                torchao[(setup, what, r["call"])] = r
    recipes = [name for name in RECIPE_ORDER if any(key[2] == name for key in newest)]
    recipes += sorted({key[2] for key in newest} - set(recipes))
    lines = ["| setup | in FP8 | " + " | ".join(recipes) + " |", "|---|---|" + "---|" * len(recipes)]
    for setup in sorted(with_te, key=lambda s: tuple(map(str, s))):
        shape, gpus, device, mesh, seq, micro, global_batch, *options = setup
        label = (f"{shape}, {gpus}x {gpu_name(device)}, {mesh}, seq {seq}, {micro}/{global_batch}, "
                 f"{' '.join(options) or '-'}")
        extents = sorted({key[1] for key in newest if key[0] == setup and key[1]}, key=lambda e: (len(e), e))
        for what in extents:
            cells = []
            for name in recipes:
                r = newest.get((setup, "" if name == "bf16" else what, name))
                beside = torchao.get((setup, what, r.get("call"))) if r and name.startswith("te ") else None
                cells.append(_cell(r, beside))
            lines.append(f"| {label} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(r: dict | None, torchao: dict | None) -> str:
    """A run's tokens/s (MFU), its speed over torchao's run of the same call where given, its commit."""
    if r is None:
        return ""
    mfu = f" ({r['mfu_pct']:.1f}%)" if r.get("mfu_pct") is not None else ""
    ratio = f", {r['tokens_per_sec_per_gpu'] / torchao['tokens_per_sec_per_gpu']:.3f}x" if torchao else ""
    return f"{r['tokens_per_sec_per_gpu']:,.0f}{mfu}{ratio}, {r['commit']}"


def record_curves(path: Path, name: str, losses: dict[int, float], about: dict) -> None:
    """Adds (or replaces) one named curve in the curves file; `about` says how the curves were run."""
    record = json.loads(path.read_text()) if path.exists() else {"losses": {}}
    record.update(about)
    record["losses"][name] = {str(step): loss for step, loss in sorted(losses.items())}
    write_atomic(path, lambda file: file.write((json.dumps(record, indent=1) + "\n").encode()))


def curves_table(path: Path, window: int = 10, tail: int = 20) -> str:
    """The curves file as a markdown table (see `curve_report`), with how and where it was run."""
    if not path.exists():
        return f"(no curves recorded: `python -m tools.te_check --phase curves` writes {path})"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not JSON ({error.msg}); run python -m tools.te_check --phase curves again") from None
    order = record.get("curves", [])  # the run order: bf16 first, whichever finished first
    names = sorted(record["losses"], key=lambda name: order.index(name) if name in order else len(order))
    losses = {name: {int(step): loss for step, loss in record["losses"][name].items()} for name in names}
    about = ", ".join(str(record[key]) for key in ("date", "commit", "device", "torch", "te") if key in record)
    return f"{curve_report(losses, window, tail)}\n\n`{' '.join(record.get('args', []))}`; {about}."


def curve_report(losses: dict[str, dict[int, float]], window: int = 10, tail: int = 20) -> str:
    """Each curve against the first ("bf16"): a markdown table of `window`-step mean losses, the
    first curve's in full and the others' as relative differences, then per curve the mean
    difference over the last `tail` steps and the mean absolute per-step difference from step 11
    on. "bf16 again" (the same seed once more) shows how far two bf16 runs drift apart through
    non-deterministic kernels alone; curves named like the first are also the reference in a last
    row, by their mean over the last `tail` steps."""
    names = list(losses)
    reference = losses[names[0]]
    steps = sorted(set.intersection(*(set(curve) for curve in losses.values())))
    if len(steps) < max(window, tail):
        raise ValueError(f"the curves share {len(steps)} steps; run at least {max(window, tail)}")

    def mean(curve: dict[int, float], chosen: list[int]) -> float:
        return sum(curve[step] for step in chosen) / len(chosen)

    def difference(name: str, chosen: list[int]) -> str:
        return f"{100 * (mean(losses[name], chosen) / mean(reference, chosen) - 1):+.2f}%"

    marks = sorted({steps[0], *(s for s in steps if s % 50 == 0 and s >= window), steps[-1]})
    lines = [f"| steps | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for mark in marks:
        chosen = [s for s in steps if mark - window < s <= mark]
        cells = [f"{mean(reference, chosen):.4f}", *(difference(name, chosen) for name in names[1:])]
        lines.append(f"| {chosen[0]}-{chosen[-1]} | {' | '.join(cells)} |")
    last, later = steps[-tail:], [s for s in steps if s > 10]
    lines.append(f"| steps {last[0]}-{last[-1]} | | " + " | ".join(difference(name, last) for name in names[1:]) + " |")
    repeats = [name for name in names if name.startswith(names[0])]
    if len(repeats) > 1:
        # Repeated reference runs differ by as much as their kernels' non-determinism takes them
        # apart; their mean is the fairer reference.
        both = sum(mean(losses[name], last) for name in repeats) / len(repeats)
        cells = [f"{100 * (mean(losses[name], last) / both - 1):+.2f}%" for name in names]
        lines.append(f"| steps {last[0]}-{last[-1]} against the mean of {' and '.join(repeats)} | "
                     + " | ".join(cells) + " |")
    per_step = [100 * sum(abs(losses[name][s] / reference[s] - 1) for s in later) / len(later) for name in names[1:]]
    lines.append(f"| mean absolute per-step difference, steps {later[0]}-{later[-1]} | | "
                 + " | ".join(f"{value:.2f}%" for value in per_step) + " |")
    return "\n".join(lines)
