"""One run per run directory: a second run stops in one line and the first trains on; a lock left
by a run that is gone (dead pid, an earlier incarnation of this job, a host that stopped beating)
is taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtrain.resilience import run_lock
from dtrain.resilience.run_lock import LOCK, RunDirLock
from models.errors import UserError
from dtrain.run import main
from tests.launch import TINY_ARGS
from tests.unit.test_run_lock import _holder
from tests.unit.test_run_lock import no_job  # noqa: F401  (a fixture of these tests)


def test_a_live_process_keeps_the_lock_and_a_dead_or_reused_pid_loses_it(tmp_path, no_job, caplog):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _holder(tmp_path, pid=sleeper.pid, started=run_lock.process_start_time(sleeper.pid))
        with pytest.raises(UserError, match=rf"is in use by another run \(pid {sleeper.pid} on host "):
            RunDirLock(tmp_path).acquire()
        # The same pid with another start time is another process now: the holder is gone.
        _holder(tmp_path, pid=sleeper.pid, started="1")
        lock = RunDirLock(tmp_path)
        lock.acquire()
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        sleeper.kill()
        sleeper.wait()
    _holder(tmp_path, pid=sleeper.pid)  # reaped: dead
    with caplog.at_level("INFO", logger="dtrain"):
        lock = RunDirLock(tmp_path)
        lock.acquire()
    assert f"from a run that is gone (pid {sleeper.pid}" in caplog.text and "its process has ended" in caplog.text
    lock.release()
    assert not (tmp_path / LOCK).exists()


def _tree(directory) -> dict[str, float]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*"))}


def test_a_second_run_in_the_same_directory_stops_in_one_line_before_touching_it(tmp_path, no_job, capsys):
    """The first run (its rank 0 a live process here) is saving step 4 and has a failure record
    of an earlier attempt: the second run, resumed or fresh, changes neither (without the lock it
    deletes the in-flight step_N.tmp and sets the failure record aside)."""
    run_dir = tmp_path / "run"
    in_flight = run_dir / "checkpoints" / "step_000004.tmp"
    in_flight.mkdir(parents=True)
    (in_flight / "__0_0.distcp").write_bytes(b"being written")
    (run_dir / "failures").mkdir()
    (run_dir / "failures" / "rank_00000.jsonl").write_text("{}\n")
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _holder(run_dir, pid=first.pid, started=run_lock.process_start_time(first.pid))
        before = _tree(run_dir)
        for extra in ([], ["--resume"]):
            code = main([*TINY_ARGS, "--run-dir", str(run_dir), *extra])
            out, err = capsys.readouterr()
            assert code == 2 and err.count("\n") == 1, err
            assert f"dtrain: error: --run-dir {run_dir} is in use by another run (pid {first.pid} on host " in err
            assert "step 1/" not in out
            after = {name: mtime for name, mtime in _tree(run_dir).items() if not name.startswith(".run.lock")}
            assert after == before
    finally:
        first.kill()
        first.wait()
