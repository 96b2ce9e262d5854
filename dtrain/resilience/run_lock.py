"""One run per run directory: rank 0 holds `RUN_DIR/run.lock` (host, pid, job) while it trains.

    claim = take(run_dir)                            # rank 0, first of all (no torch needed)
    ...                                              # the failure record, where claim.held
    claim = agree(run_dir, rank, world_size, claim)  # every rank, once the process group is up
    try:
        train()
    finally:
        if claim is not None:                        # rank 0's
            claim.release()

A second run in the same directory stops in one line on every rank before it writes anything
there: rank 0 takes the lock before anything else touches the directory, and every rank raises
its refusal once the process group can carry it. A lock whose holder is gone is taken over,
saying so:

- on this host, its pid is dead, or is another process now (its start time differs);
- on another host, it belongs to this job (the same SLURM job and step, or the same torchrun
  rendezvous id): a restart of this job (`torchrun --max-restarts`, a SLURM requeue) whose rank 0
  now runs on another node;
- on another host and another job: the holder rewrites the lock every `HEARTBEAT_S` seconds, so
  a lock that does not change for `STALE_S` seconds, watched from here (the hosts' clocks need not
  agree), belongs to a run that is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import attrs

from models.errors import UserError

logger = logging.getLogger("dtrain")

LOCK = "run.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0


def job_id() -> str | None:
    """The job this process belongs to, the same in every restart of it: SLURM's job and step, or
    torchrun's rendezvous id (None when neither names one)."""
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm {slurm}.{os.environ.get('SLURM_STEP_ID', 'batch')}"
    rendezvous = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return None if rendezvous in ("", "none") else f"torchrun {rendezvous}"


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before ")" may hold spaces


def process_alive(pid: int, started: str | None) -> bool:
    """Whether process `pid` of this host runs and, where `started` is known, is the one that
    started then (not a later process given the same pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = process_start_time(pid)
    return now is None or started is None or now == started


def describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {since}"


class RunDirLock:
    """The lock file of one run directory, taken by rank 0 (`acquire`, `release`)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "started": process_start_time(os.getpid()), "job": job_id(), "since": time.time(), "beat": 0}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.created = False  # the run directory, by `acquire`

    def acquire(self) -> None:
        try:
            self.created = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with self._decision():
                holder = self._read()
                if holder is not None and not self._is_mine(holder):
                    reason = self._stale(holder)
                    if reason is None:
                        raise UserError(f"--run-dir {self.run_dir} is in use by another run ({describe(holder)}); "
                                        f"choose another --run-dir or stop that run (if it is gone, delete {self.path})")
                    logger.info("took over %s from a run that is gone (%s): %s", self.path, describe(holder), reason)
                self._write()
        except OSError as error:
            raise UserError(f"--run-dir {self.run_dir} is not writable ({error.strerror or error}); choose "
                            f"another --run-dir") from None
        self._heartbeat = threading.Thread(target=self._beat, name="dtrain-run-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with contextlib.suppress(OSError):
            if self._is_mine(self._read()):
                self.path.unlink()
            # A run refused before any work (bad flags) leaves no directory that it made.
            guard = self._guard_path()
            if self.created and [p for p in self.run_dir.iterdir() if p != guard] == []:
                guard.unlink(missing_ok=True)
                self.run_dir.rmdir()

    @contextlib.contextmanager
    def _decision(self):
        """Two runs starting together take turns at reading and writing the lock (flock; where the
        file system has no locks, the lock file alone)."""
        with open(self._guard_path(), "a") as guard:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX)
            except OSError:
                pass
            yield

    def _guard_path(self) -> Path:
        return self.run_dir / f".{LOCK}.guard"

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: no holder can be named or watched

    def _write(self) -> None:
        tmp = self.path.with_name(f".{LOCK}.{self.me['host']}.{self.me['pid']}.tmp")
        tmp.write_text(json.dumps(self.me))
        os.replace(tmp, self.path)

    def _is_mine(self, holder: dict | None) -> bool:
        return bool(holder) and holder.get("host") == self.me["host"] and holder.get("pid") == self.me["pid"]

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is gone, or None when it may be alive."""
        if not holder:
            return "the lock file is unreadable"
        if holder.get("host") == self.me["host"]:
            alive = process_alive(int(holder.get("pid", -1)), holder.get("started"))
            return None if alive else "its process has ended"
        if holder.get("job") is not None and holder.get("job") == self.me["job"]:
            return f"it is an earlier incarnation of this job ({self.me['job']})"
        logger.info("%s is held by %s; watching its heartbeat for up to %.0f s to tell whether that run is alive",
                    self.path, describe(holder), STALE_S)
        deadline = time.monotonic() + STALE_S
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(HEARTBEAT_S / 2, left))
            if self._read() != holder:
                return None
        return f"its heartbeat stopped ({STALE_S:.0f} s without one)"

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                holder = self._read()
                if not self._is_mine(holder):
                    logger.warning("%s now names %s, not this run", self.path, describe(holder or {}))
                    return
                self.me["beat"] += 1
                self._write()


@attrs.frozen
class Claim:
    """Rank 0's outcome of taking the lock: the lock it holds, or why it may not."""

    lock: RunDirLock | None = None
    refusal: str | None = None

    @property
    def held(self) -> bool:
        return self.lock is not None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def take(run_dir: Path, prepare: Callable[[], None] | None = None) -> Claim:
    """Rank 0 takes the run directory's lock, then calls `prepare()` (which checks or clears what
    the directory holds); a refusal of either is kept to be raised on every rank."""
    lock = RunDirLock(run_dir)
    try:
        lock.acquire()
    except UserError as error:
        return Claim(refusal=str(error))
    if prepare is not None:
        try:
            prepare()
        except UserError as error:
            lock.release()
            return Claim(refusal=str(error))
    return Claim(lock=lock)


def agree(run_dir: Path, rank: int, world_size: int, claim: Claim | None = None,
          prepare: Callable[[], None] | None = None) -> Claim | None:
    """Every rank, once the process group is up: rank 0's claim (taken here with `prepare` when
    None) if this run holds the directory, else rank 0's refusal raised on every rank, so that all
    of them stop before touching the directory. The caller releases the claim when the run ends."""
    if rank == 0 and claim is None:
        claim = take(run_dir, prepare)
    refusal = claim.refusal if claim is not None else None
    if world_size > 1:
        import torch.distributed as dist

        box = [refusal]
        try:
            dist.broadcast_object_list(box, src=0)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        refusal = box[0]
    if refusal is not None:
        raise UserError(refusal, every_rank=True)
    return claim
