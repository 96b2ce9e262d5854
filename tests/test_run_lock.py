"""One run per run directory: a second run stops in one line and the first trains on; a lock left
by a run that is gone (dead pid, an earlier incarnation of this job, a host that stopped beating)
is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from dtrain.resilience import run_lock
from dtrain.resilience.run_lock import LOCK, RunDirLock, agree, take
from models.errors import UserError
from dtrain.run import main
from tests.launch import TINY_ARGS


def _holder(tmp_path, **fields) -> dict:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": None, "job": None, "since": 0.0, "beat": 0,
              **fields}
    (tmp_path / LOCK).write_text(json.dumps(holder))
    return holder


@pytest.fixture
def no_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


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


def test_a_restart_of_the_same_job_on_another_host_takes_the_lock_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    _holder(tmp_path, host="node-17", pid=1, job="slurm 4242.0")
    lock = RunDirLock(tmp_path)
    lock.acquire()
    lock.release()
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # another srun step of the allocation: another run
    monkeypatch.setattr(run_lock, "STALE_S", 0.4)
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.1)
    holder = _holder(tmp_path, host="node-17", pid=1, job="slurm 4242.0")
    stop = threading.Event()

    def beat():  # the other host's run, alive
        while not stop.wait(0.05):
            holder["beat"] += 1
            (tmp_path / LOCK).write_text(json.dumps(holder))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(UserError, match="pid 1 on host node-17, job slurm 4242.0"):
            RunDirLock(tmp_path).acquire()
    finally:
        stop.set()
        beating.join()
    started = time.monotonic()
    lock = RunDirLock(tmp_path)
    lock.acquire()  # no heartbeat for STALE_S: gone
    assert time.monotonic() - started >= 0.4
    lock.release()


def test_the_holder_beats_and_a_refusal_reaches_every_rank_before_the_directory_is_touched(tmp_path, no_job,
                                                                                            monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    claim = agree(tmp_path, rank=0, world_size=1)
    time.sleep(0.3)
    held = json.loads((tmp_path / LOCK).read_text())
    assert held["pid"] == os.getpid() and held["beat"] >= 2
    claim.release()
    claim.release()  # the run's end and the command's end both release it
    assert not (tmp_path / LOCK).exists()
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    refused = take(not_a_directory / "run")
    assert not refused.held and "is not writable" in refused.refusal
    with pytest.raises(UserError, match="is not writable"):
        agree(not_a_directory / "run", rank=0, world_size=1, claim=refused)


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
