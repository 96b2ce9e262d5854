"""Compares the per-step scalars of two runs (e.g. the same model on two meshes):

    python -m tools.compare_runs runs/single runs/cp2 [--tags train/loss train/grad_norm]

For each tag, the largest relative difference |b - a| / |a| over the steps both runs logged,
read from their TensorBoard files. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (run_dir / "tensorboard").is_dir():
        raise SystemExit(f"error: {run_dir} has no tensorboard/ folder; pass a dtrain run directory")
    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def compare(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]], tags: list[str]) -> dict:
    result = {}
    for tag in tags:
        if tag not in a or tag not in b:
            raise SystemExit(f"error: {tag!r} is missing from one of the runs")
        steps = sorted(set(a[tag]) & set(b[tag]))
        if not steps:
            raise SystemExit(f"error: the runs share no step of {tag!r}")
        diffs = [abs(b[tag][s] - a[tag][s]) / max(abs(a[tag][s]), 1e-30) for s in steps]
        worst = max(range(len(steps)), key=diffs.__getitem__)
        result[tag] = {"steps": len(steps), "max_rel_diff": diffs[worst], "at_step": steps[worst],
                       "mean_rel_diff": sum(diffs) / len(diffs)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compare_runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--tags", nargs="+", default=["train/loss", "train/grad_norm"])
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result = compare(read_scalars(args.reference), read_scalars(args.other), args.tags)
    print(json.dumps({"reference": str(args.reference), "other": str(args.other), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
