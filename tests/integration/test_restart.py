"""Automatic restarts under torchrun --max-restarts: a rank killed mid-run restarts every rank from
the latest checkpoint with the losses of an uninterrupted run, bit for bit; a failure that comes
back at the same step stops the job instead of spending its restarts."""

from __future__ import annotations

import json
import os

import pytest

from dtrain.resilience import failures
from tests.launch import TINY_ARGS, run_cli, scalars


@pytest.mark.slow
@pytest.mark.timeout(600)  # two start-ups of two processes
def test_a_rank_killed_mid_run_restarts_every_rank_from_the_latest_checkpoint_bit_for_bit(tmp_path, dp2_run):
    args = [*TINY_ARGS, "--run-dir", str(tmp_path), "--checkpoint-every", "2", "--resume", "auto"]
    result = run_cli(args, nproc=2, torchrun_args=("--max-restarts", "1"), env={"DTRAIN_FAULT": "crash@rank1:step5"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fault injection: crash@rank1:step5" in result.stdout
    assert "resumed from" in result.stdout and "step_000004 at step 4" in result.stdout, result.stdout[-3000:]
    # Steps 1-4 from the first attempt, 5-10 from the restart (TensorBoard dropped what came after 4).
    assert scalars(tmp_path)["train/loss"] == dp2_run["train/loss"]
    [record] = [json.loads(line) for line in (tmp_path / "failures" / "rank_00000.jsonl").read_text().splitlines()]
    assert (record["kind"], record["step"], record["key"], record["attempt"]) == ("lost", 5, "lost: rank 1 exited", [0, 0])


@pytest.mark.slow
@pytest.mark.timeout(600)  # two start-ups of two processes
def test_a_failure_that_comes_back_at_the_same_step_stops_the_restarts(tmp_path):
    """Rank 1 crashes at step 3 in every attempt (tests.workers.crash_every_time). Attempt 0 saves
    step 2 and fails; attempt 1 resumes from it and fails alike; attempt 2 stops at once with one
    line, before importing torch, and so does attempt 3, the last torchrun allows."""
    args = [*TINY_ARGS, "--steps", "4", "--run-dir", str(tmp_path), "--checkpoint-every", "2", "--resume", "auto"]
    result = run_cli(args, nproc=2, module="tests.workers.crash_every_time", torchrun_args=("--max-restarts", "3"),
                     env={"DTRAIN_FAULT": "crash@rank1:step3"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert output.count("fault injection: crash@rank1:step3") == 2, output[-5000:]  # not 4
    stops = [line for line in output.splitlines() if "failed the same way in two attempts in a row" in line]
    assert len(stops) == 2 and stops[0].startswith("dtrain: error: the job failed the same way"), output[-5000:]
    assert "at step 3: rank 0 at step 3" in stops[0] and "rank 1" in stops[0], stops[0]
    recorded = failures.read(tmp_path)
    assert {tuple(f.attempt) for f in recorded} == {(0, 0), (0, 1)} and {f.step for f in recorded} == {3}
    assert "step 4/4" not in output
    assert not os.path.exists(tmp_path / "checkpoints" / "step_000004")
