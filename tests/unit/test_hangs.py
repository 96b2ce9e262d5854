"""Hangs: the watchdog names the ranks the job waits for, collectives follow the step timeout,
and a stopped rank ends the run within the step timeout + 30 s (gloo, CPU)."""

from __future__ import annotations

import re
import time

import torch.distributed as dist

from dtrain.resilience import failures
from dtrain.resilience.heartbeat import Board, Heartbeat
from dtrain.resilience.watchdog import Watchdog, diagnose, format_ranks, poll_interval


def _beat(step: int, phase: str, beat: float) -> dict:
    return {"step": step, "phase": phase, "beat": beat}


def test_the_report_names_stopped_ranks_then_laggards_then_where_the_others_wait():
    now = 1000.0
    line, key = diagnose({0: _beat(3, "forward", 999), 1: _beat(3, "data", 980), 2: _beat(3, "forward", 999.5)},
                         now, stale_after=5)
    assert line.startswith("rank 1 stopped responding in step 3 (data) or just after: no heartbeat for 20 s")
    assert "ranks 0, 2 wait in forward of step 3" in line and key == "stopped rank 1 at data"
    # All alive: the rank still in an earlier phase is the one the others wait for.
    line, key = diagnose({r: _beat(7, "backward", 999) for r in range(4)} | {2: _beat(7, "data", 999)}, now, 5)
    assert line.startswith("rank 2 still in data of step 7, behind the others; ranks 0-1, 3 wait in backward")
    assert key == "behind rank 2 at data"
    # Everyone at the same place: no rank to blame, a collective that does not complete.
    line, key = diagnose({0: _beat(2, "sync", 999), 1: _beat(2, "sync", 999)}, now, 5)
    assert "no rank is behind" in line and key == "collective"
    line, key = diagnose({0: _beat(2, "sync", 999), 1: None}, now, 5)
    assert line.startswith("rank 1 never reported a heartbeat") and key == "missing rank 1"
    assert format_ranks([9, 0, 1, 2, 3, 6, 8]) == "ranks 0-3, 6, 8-9" and format_ranks([4]) == "rank 4"
    assert poll_interval(120) == 5.0 and poll_interval(10) == 1.0


def test_a_frozen_rank_is_placed_by_where_the_others_got_not_by_its_stale_heartbeat():
    """A rank frozen with its watchdog (SIGSTOP) last published between two polls: steps that are
    fast next to the poll leave that beat steps behind. The others waiting in step 3 passed the
    collective at the end of step 2, which the frozen rank joined too."""
    line, key = diagnose({0: _beat(3, "forward", 999), 1: _beat(0, "init", 989), 2: _beat(3, "forward", 999)},
                         1000.0, stale_after=5)
    assert line.startswith("rank 1 stopped responding in step 3 or at the end of step 2 (its last heartbeat, 11 s "
                           "old, is from step 0 (init)): the process is frozen or gone"), line
    assert "ranks 0, 2 wait in forward of step 3" in line and key == "stopped rank 1"
    # Not ahead of its own beat, and not a step the others have not reached.
    line, _ = diagnose({0: _beat(3, "forward", 999), 1: _beat(3, "backward", 989)}, 1000.0, stale_after=5)
    assert line.startswith("rank 1 stopped responding in step 3 (backward) or just after"), line
    line, _ = diagnose({0: _beat(1, "forward", 999), 1: _beat(0, "init", 989)}, 1000.0, stale_after=5)
    assert line.startswith("rank 1 stopped responding in step 0 (init) or just after"), line


def test_the_watchdog_reports_a_training_thread_that_stops_making_progress(tmp_path):
    """One rank in this process: its 'training thread' (this test) sits in forward of step 4
    past the step timeout; the report, the failure record and the stacks must name it."""
    beat = Heartbeat(rank=0)
    watchdog = Watchdog(beat, Board(dist.HashStore(), 0), run_dir=tmp_path, world_size=1, init_timeout=30,
                        step_timeout=2, exit_process=False)
    watchdog.start()
    try:
        watchdog.starting_at(3)
        beat.begin_step(4)
        watchdog.step_done(4, seconds=0.1)  # the first step is done: steps now run under --step-timeout
        beat.phase("forward")
        deadline = time.monotonic() + 20
        while watchdog.report is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        watchdog.close()
    assert watchdog.report is not None and watchdog.limit() == 2
    assert re.fullmatch(r"hang: rank 0 made no progress for \d+ s in forward of step 4", watchdog.report), \
        watchdog.report
    [recorded] = failures.read(tmp_path)
    assert (recorded.kind, recorded.step, recorded.phase, recorded.key) == ("hang", 4, "forward", "no progress in forward")
    stacks = (tmp_path / "hangs" / "rank_00000.txt").read_text()
    assert "test_the_watchdog_reports_a_training_thread" in stacks  # this thread's frame


def test_long_phases_and_the_step_after_a_save_run_under_the_init_timeout(tmp_path):
    timeouts = []
    watchdog = Watchdog(Heartbeat(0), Board(dist.HashStore(), 0), run_dir=tmp_path, world_size=1,
                        init_timeout=600, step_timeout=60)
    watchdog.adopt_groups(["group"], lambda seconds, groups: timeouts.append(seconds))
    watchdog.starting_at(10)
    assert watchdog.limit() == 600 and timeouts[-1] == 620  # collectives: the limit + 20 s
    watchdog.beat.begin_step(11)
    watchdog.step_done(11, seconds=1.0)
    assert watchdog.limit() == 60 and timeouts[-1] == 80
    watchdog.beat.phase("checkpoint")
    assert watchdog.limit() == 600 and timeouts[-1] == 80  # a phase's own limit; collectives unchanged
    watchdog.beat.phase("forward")
    watchdog.relax(until_step=13)  # a save at step 12: rank 0 may commit while the others go on
    watchdog.step_done(12, seconds=1.0)
    assert watchdog.limit() == 600 and timeouts[-1] == 620
    watchdog.step_done(13, seconds=1.0)
    assert watchdog.limit() == 60 and timeouts[-1] == 80
