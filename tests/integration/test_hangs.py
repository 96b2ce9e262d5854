"""Hangs: the watchdog names the ranks the job waits for, collectives follow the step timeout,
and a stopped rank ends the run within the step timeout + 30 s (gloo, CPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.launch import REPO, TINY_ARGS, cli_command, cli_env, run_cli


@pytest.mark.slow
def test_a_groups_collective_timeout_can_be_shortened_once_steps_run():
    """gloo: groups created with 60 s time out after 2 s once set so (the default group and a
    subgroup), which is what --step-timeout does to a running job's groups."""
    result = run_cli([], nproc=2, module="tests.workers.collective_timeout", timeout=300)
    elapsed = [float(s) for s in re.findall(r"timed out after ([\d.]+) s", result.stdout)]
    assert len(elapsed) == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert all(1.5 <= s < 6 for s in elapsed), elapsed


def _stop_rank_1(run_dir, step_timeout: int) -> tuple[str, float]:
    """Runs two ranks whose rank 1 stops (SIGSTOP) as step 3 begins; the run must fail. Returns its
    output and the seconds from the stop to the run's end."""
    args = [*TINY_ARGS, "--steps", "5", "--run-dir", str(run_dir), "--step-timeout", str(step_timeout)]
    proc = subprocess.run(cli_command(args, nproc=2), cwd=REPO, env=cli_env({"DTRAIN_FAULT": "hang@rank1:step3"}),
                          capture_output=True, text=True, timeout=600)
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    return output, ended - (run_dir / "faults" / "hang@rank1:step3.rank1").stat().st_mtime


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_step_timeout_and_is_named(tmp_path):
    """hang@rank1:step3 SIGSTOPs rank 1 as step 3 begins; rank 0 waits in its first collective.
    The run must exit non-zero within --step-timeout + 30 s of the stop, naming rank 1."""
    output, took = _stop_rank_1(tmp_path, step_timeout=10)
    assert 10 < took < 10 + 30, (took, output[-3000:])
    [error] = [line for line in output.splitlines() if line.startswith("dtrain: error: hang:")]
    # Where rank 1 was when it froze is its last published heartbeat (its watchdog froze with it).
    assert re.search(r"rank 1 stopped responding in step 3\b", error), error
    assert "rank 0 waits in forward of step 3" in error, error
    assert "frozen, it cannot take torchrun's SIGTERM" in output  # killed: torchrun need not wait 30 s
    [record] = [json.loads(line) for line in (tmp_path / "failures" / "rank_00000.jsonl").read_text().splitlines()]
    assert record["kind"] == "hang" and record["step"] == 3 and record["key"].startswith("stopped rank 1")
    assert "most recent call first" in (tmp_path / "hangs" / "rank_00000.txt").read_text()


@pytest.mark.gpu
def test_a_stopped_rank_on_nccl_is_named_and_its_flight_recorder_written(tmp_path):
    """Two GPUs: the same stop as above, on NCCL (the host waits on an event that releases the
    GIL, so the watchdog runs). With the report, rank 0 writes NCCL's flight recorder."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    output, took = _stop_rank_1(tmp_path, step_timeout=20)
    assert 20 < took < 20 + 30, (took, output[-3000:])
    assert re.search(r"hang: rank 1 stopped responding in step \d", output), output[-3000:]
    dumps = sorted(p.name for p in (tmp_path / "flight_recorder").iterdir())
    assert "rank_0" in dumps, (dumps, output[-3000:])


_EXIT_AFTER_CLOSE = """
import datetime, sys, threading, time
import torch.distributed as dist
from dtrain.resilience.heartbeat import Board, Heartbeat
from dtrain.resilience.watchdog import Watchdog

class SlowStore:
    # Each publish waits 0.3 s inside a c10d call, the GIL released, as a store on a busy host does.
    def __init__(self):
        self.store = dist.HashStore()

    def set(self, key, value):
        try:
            self.store.wait(["never"], datetime.timedelta(seconds=0.3))
        except Exception:
            pass
        self.store.set(key, value)

watchdog = Watchdog(Heartbeat(0), Board(SlowStore(), 0), run_dir=sys.argv[1], world_size=1, init_timeout=30,
                    step_timeout=2, exit_process=False)
watchdog.start()
time.sleep(0.25)  # the thread is in its first publish
watchdog.close()
print("closed", flush=True)
"""


def test_a_run_that_ends_while_the_watchdog_publishes_exits_cleanly(tmp_path):
    """The watchdog thread is a daemon: left inside a store call when the interpreter exits, it
    aborts a run that succeeded ("terminate called without an active exception", SIGABRT, seen in
    about one full suite of ten). close() waits for it."""
    result = subprocess.run([sys.executable, "-c", _EXIT_AFTER_CLOSE, str(tmp_path)], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and "closed" in result.stdout, (result.returncode, result.stderr[-2000:])
    assert "terminate called" not in result.stderr, result.stderr[-2000:]
