"""A request to save and stop, made by a file in the run directory:

    touch RUN_DIR/stop    # the run saves at its next step boundary, exits 0 and removes the file

The SLURM launcher writes it when SLURM announces the end of the job's time (USR1). Unlike a
signal it reaches every node through the shared run directory, and it does not go through
torchrun, whose agent answers a SIGTERM by killing its workers 30 s later, whatever their save.
Rank 0 looks for the file every few seconds (one stat, at a step boundary); the other ranks
learn of it when the ranks agree at every step's end whether to stop.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

STOP = "stop"
CHECK_EVERY_S = 5.0


def request(run_dir: Path, reason: str) -> None:
    """Asks the run in `run_dir` to save and stop; `reason` is logged when it does."""
    path = Path(run_dir) / STOP
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STOP}.{os.getpid()}")
    tmp.write_text(reason.strip() + "\n")
    tmp.replace(path)


def pending(run_dir: Path) -> bool:
    return (Path(run_dir) / STOP).exists()


class StopRequest:
    """Rank 0's view of RUN_DIR/stop (`enabled` False on the other ranks: they never look)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path = Path(run_dir) / STOP
        self.enabled = enabled
        self._next_check = 0.0

    def poll(self) -> str | None:
        """The request's reason when the file exists (looked for at most every CHECK_EVERY_S)."""
        now = time.monotonic()
        if not self.enabled or now < self._next_check:
            return None
        self._next_check = now + CHECK_EVERY_S
        try:
            with open(self.path, "rb") as f:
                head = f.read(200).decode(errors="replace").strip()  # the reason's first line
        except FileNotFoundError:
            return None
        except OSError as error:  # a directory, no permission: still a request to stop
            head = f"unreadable ({error})"
        text = head.splitlines()[0] if head else ""
        return f"a stop request ({self.path}: {text})" if text else f"a stop request ({self.path})"

    def clear(self) -> None:
        """Done with: the run saved and stops (a requeued job must not stop again at once)."""
        if not self.enabled:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:  # not a file, or a read-only run directory: the next start stops again
            logging.getLogger("dtrain").warning("could not remove the stop request %s: %s", self.path, error)
