"""Stragglers: each rank's forward compute time, compared with the median of its peers; a rank
that stays slower is named, and the step's numbers do not change."""

from __future__ import annotations

import re

import pytest

from tests.launch import TINY_ARGS, run_cli, scalars


@pytest.mark.slow
def test_a_slow_rank_is_named_and_the_losses_do_not_change(tmp_path, dp2_run):
    """Rank 1's layers each take 30 ms longer (tests.workers.slow_rank), a straggler check every
    2 steps: the ratio is logged at steps 2..10 and rank 1 is named at the third check."""
    result = run_cli([*TINY_ARGS, "--run-dir", str(tmp_path), "--straggler-every", "2"], nproc=2,
                     module="tests.workers.slow_rank",
                     env={"DTRAIN_TEST_SLOW_RANK": "1", "DTRAIN_TEST_SLOW_SECONDS": "0.03"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = scalars(tmp_path)
    assert run["train/loss"] == dp2_run["train/loss"]  # timing only: not one bit of the numbers moves
    ratios = run["perf/straggler_ratio"]
    # Rank 1's forward: 4 layers x 2 micro-batches x 30 ms on top of the same work as rank 0's.
    assert len(ratios) == 5 and min(ratios) > 1.5, ratios
    warnings = [line for line in result.stdout.splitlines() if "straggler: rank" in line]
    assert len(warnings) == 1 and re.search(r"straggler: rank 1 computed [\d.]+x .* \(steps 2, 4, 6\)", warnings[0])
