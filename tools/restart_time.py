"""How long an automatic restart takes: kills one rank mid-run under `torchrun --max-restarts 1`
and measures from the kill to the first step the restarted workers complete.

    python -m tools.restart_time --nproc 2 --kill-at 6 -- --model tiny --steps 10 --checkpoint-every 4
    python -m tools.restart_time --nproc 2 --kill-at 25 -- --model llama-1b --seq-len 4096 --micro-batch 4 \\
        --data synthetic --compile --steps 40 --checkpoint-every 20

The rank dies by DTRAIN_FAULT=crash@rankR:stepS (SIGKILL as step S begins; the fault's marker file
is written just before, so its time is the kill's). The restarted workers load the latest
checkpoint and run again from there; the first step they complete is read from TensorBoard's
wall time. Prints one JSON line: `kill_to_first_step_s` (all of it: noticing the death, stopping
the other ranks, starting new workers, rendezvous, loading, compiling again, and that step),
`first_step_s` (that step alone, compilation included) and `resumed_from_step`.
Arguments after `--` go to dtrain's CLI; --run-dir defaults to a fresh runs/restart-time-N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path


def first_step_after(run_dir: Path, kill_time: float) -> tuple[int, float, float]:
    """(step, wall time, tokens/s/GPU) of the first step TensorBoard received after `kill_time`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    after = [e for e in accumulator.Scalars("train/loss") if e.wall_time > kill_time]
    if not after:
        raise SystemExit(f"error: no step completed after the kill in {run_dir}; see its train.log")
    first = min(after, key=lambda e: e.wall_time)
    rates = {e.step: e.value for e in accumulator.Scalars("perf/tokens_per_sec_per_gpu") if e.wall_time > kill_time}
    return first.step, first.wall_time, rates.get(first.step, 0.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    at = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m tools.restart_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) on this machine")
    parser.add_argument("--kill-at", type=int, required=True, help="the step whose start kills the rank")
    parser.add_argument("--rank", type=int, default=1, help="the rank to kill")
    args = parser.parse_args(argv[:at])
    if not 0 <= args.rank < args.nproc:
        parser.error(f"--rank {args.rank} is not one of the {args.nproc} ranks; give --rank below --nproc")
    extra = argv[at + 1:]
    if "--run-dir" not in extra:
        extra += ["--run-dir", f"runs/restart-time-{int(time.time())}"]
    run_dir = Path(extra[extra.index("--run-dir") + 1])
    fault = f"crash@rank{args.rank}:step{args.kill_at}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "--max-restarts=1", "-m", "dtrain.run", *extra, "--resume", "auto"]
    result = subprocess.run(command, env={**os.environ, "DTRAIN_FAULT": fault})
    if result.returncode != 0:
        raise SystemExit(f"error: the run failed (exit {result.returncode}); see {run_dir}/train.log")
    kill_time = (run_dir / "faults" / f"{fault}.rank{args.rank}").stat().st_mtime
    step, wall_time, tokens_per_sec = first_step_after(run_dir, kill_time)
    resumed = [line for line in (run_dir / "train.log").read_text().splitlines() if "resumed from" in line]
    config = tomllib.loads((run_dir / "config.toml").read_text())
    tokens = config["data"]["global_batch"] * config["data"]["seq_len"]
    print(json.dumps({
        "nproc": args.nproc, "killed_rank": args.rank, "killed_at_step": args.kill_at,
        "resumed_from_step": int(resumed[-1].split(" at step ")[1].split()[0]) if resumed else 0,
        "first_step": step, "kill_to_first_step_s": round(wall_time - kill_time, 2),
        "first_step_s": round(tokens / tokens_per_sec / args.nproc, 2) if tokens_per_sec else None, "args": extra,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
