"""One run per run directory: a second run stops in one line and the first trains on; a lock left
by a run that is gone (dead pid, an earlier incarnation of this job, a host that stopped beating)
is taken over."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from dtrain.resilience import run_lock
from dtrain.resilience.run_lock import LOCK, RunDirLock, agree, take
from models.errors import UserError


def _holder(tmp_path, **fields) -> dict:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": None, "job": None, "since": 0.0, "beat": 0,
              **fields}
    (tmp_path / LOCK).write_text(json.dumps(holder))
    return holder


@pytest.fixture
def no_job(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


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
