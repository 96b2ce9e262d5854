"""`python -m dtrain.diagnose RUN_DIR`: why a run was slow, ran out of memory or diverged.

    python -m dtrain.diagnose runs/a                      # under 40 lines: speed, memory, loss, ranks
    python -m dtrain.diagnose runs/a --json               # the same as one JSON object, findings listed
    python -m dtrain.diagnose runs/a --plot runs/a.png    # loss, gradient norm and speed, events marked
    python -m dtrain.diagnose runs/a --profile prof/      # where the step goes, from a profile

It reads what the run wrote into its directory (config.toml, metrics.jsonl, failures/) and asks
the planner about the run's layout on the GPUs it ran on. Exit status 0 whether or not something
is wrong (a finding is an answer, not an error); 2 for a directory it cannot read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dtrain.diagnose.loss import loss_section
from dtrain.diagnose.memory import memory_section
from dtrain.diagnose.neighbours import planner_view
from dtrain.diagnose.plot import plot, pyplot
from dtrain.diagnose.profile import load_profile
from dtrain.diagnose.ranks import ranks_section
from dtrain.diagnose.record import RunRecord, load
from dtrain.diagnose.report import Diagnosis
from dtrain.diagnose.speed import speed_section
from models.errors import UserError


def header(record: RunRecord) -> str:
    c = record.config
    d, t = c.data, c.train
    last = record.steps[-1]["step"] if record.steps else 0
    n = record.world_size
    ranks = f"{n} {record.device} GPU{'s' if n > 1 else ''}" if record.on_gpu else \
        f"{n} CPU process{'es' if n > 1 else ''}"
    try:
        mesh = str(record.layout.mesh)
    except UserError:
        mesh = c.parallel.mesh
    return (f"{record.run_dir}: {c.model.model} on {ranks}, mesh {mesh}, "
            f"micro-batch {d.micro_batch} of global batch "
            f"{d.global_batch}, seq {d.seq_len}, recompute {t.recompute}; {last} of {t.steps} steps"
            + ("; no journal: it failed before its first step" if record.start.get("from_failures") else ""))


def diagnose(record: RunRecord, profile: dict[str, float] | None = None) -> Diagnosis:
    planned = planner_view(record)
    return Diagnosis(header(record), [speed_section(record, planned, profile), memory_section(record, planned),
                                      loss_section(record), ranks_section(record)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.diagnose", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the --run-dir of a dtrain run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw loss, gradient norm and speed over the steps, "
                        "with the events marked, into this PNG (needs matplotlib)")
    parser.add_argument("--profile", type=Path, metavar="TRACE",
                        help="where the step goes from a profile: python -m tools.bench --profile DIR's "
                             "profile_rank0.json (or DIR), or a trace torch.profiler exported")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.plot:
            pyplot()  # before any work: a missing matplotlib is one line
        record = load(args.run_dir)
        profile = load_profile(args.profile) if args.profile else None
        result = diagnose(record, profile)
        if args.plot:
            plot(record, args.plot)
    except UserError as error:
        print(f"dtrain.diagnose: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json(), indent=1) if args.json else result.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
