"""Where each rank is: the step it runs and the phase of it, for naming the ranks a hang waits on.

    beat = Heartbeat(rank)
    beat.begin_step(5)           # phase "data" of step 5
    beat.phase("forward")        # one tuple assignment: no I/O, no device sync, no lock
    board.publish(beat.record()) # the watchdog thread, every few seconds

The trainer only assigns; a watchdog thread (dtrain.resilience.watchdog) copies the state to the
job's key-value store, the rendezvous TCPStore that torchrun already runs, where any rank can read
every rank's last beat. A rank whose beat stops being published is frozen or gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import timedelta

# What a rank does, in the order a step does it. Times are the host's: on GPUs the device runs
# behind, and "sync" is where the host waits for it (reading a step's loss back) and for the
# other ranks (agreeing to stop or save at the step's end).
PHASES = ("init", "data", "forward", "backward", "optimizer", "sync", "eval", "checkpoint")
# Phases that may legitimately last long: they run under --init-timeout, not --step-timeout.
LONG_PHASES = frozenset({"init", "eval", "checkpoint"})


class Heartbeat:
    """This rank's (step, phase, since): written by the training thread, read by the watchdog."""

    def __init__(self, rank: int):
        self.rank = rank
        self.host = socket.gethostname()
        self.pid, self.ppid = os.getpid(), os.getppid()
        self.state = (0, "init", time.monotonic())

    def heading_for(self, step: int) -> None:
        """The step the rank will run next, known once a checkpoint is loaded (phase unchanged)."""
        self.state = (step, *self.state[1:])

    def begin_step(self, step: int) -> None:
        self.state = (step, "data", time.monotonic())

    def phase(self, name: str) -> None:
        self.state = (self.state[0], name, time.monotonic())

    @property
    def step(self) -> int:
        return self.state[0]

    @property
    def current(self) -> str:
        return self.state[1]

    def stuck_for(self) -> float:
        """Seconds since the phase began (the training thread made no visible progress since)."""
        return time.monotonic() - self.state[2]

    def record(self) -> dict:
        step, phase, _ = self.state
        return {"rank": self.rank, "step": step, "phase": phase, "beat": time.time(), "host": self.host,
                "pid": self.pid, "ppid": self.ppid}


class Board:
    """Every rank's last published heartbeat (`rank/R` -> one JSON object) in a c10d store."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank

    def publish(self, record: dict) -> None:
        self.store.set(f"rank/{self.rank}", json.dumps(record))

    def read(self, ranks) -> dict[int, dict | None]:
        """The last beat of each rank in `ranks` (None: it never published one)."""
        beats = {}
        for rank in ranks:
            key = f"rank/{rank}"
            # check() first: get() of a missing key would wait for it.
            beats[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return beats

    def claim(self, what: str) -> bool:
        """True for the first rank to claim `what` in this attempt of the job, False for the rest."""
        return self.store.add(f"claim/{what}", 1) == 1


def open_board(rank: int, world_size: int, timeout_s: float = 30.0, fallback: bool = False) -> Board:
    """A board on its own connection to the job's store, so that the watchdog never queues behind
    a store operation of the training thread (a TCPStore client runs one operation at a time).
    Keys are per torchrun attempt: a restarted job does not read the beats of the previous one.
    With `fallback`, a store that cannot be reached gives a board of this rank alone (a warning)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size == 1 or not addr or not port:
        return Board(dist.HashStore(), rank)
    try:
        client = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                               wait_for_workers=False)
    except (RuntimeError, ValueError) as error:
        if not fallback:
            raise
        logging.getLogger("dtrain").warning("heartbeat: the job's store at %s:%s is unreachable (%s); a hang "
                                            "will name this rank only", addr, port, error)
        return Board(dist.HashStore(), rank)
    prefix = (f"dtrain/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    return Board(dist.PrefixStore(prefix, client), rank)
