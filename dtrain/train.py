"""A training run from start to end: the process group, the run directory's lock and log file,
hang detection, the trainer, and the shutdown that follows an error (recorded in the run directory
for restarts, once this run holds it)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from pathlib import Path

import torch

from dtrain import distributed
from dtrain import run_directory
from dtrain.layout import RunLayout
from dtrain.metrics import log_file
from dtrain.planner import advice
from dtrain.resilience import failures, run_lock
from dtrain.resilience.heartbeat import Heartbeat, open_board
from dtrain.resilience.watchdog import GRACE_S, Watchdog
from dtrain.trainer import Trainer
from models.errors import UserError

logger = logging.getLogger("dtrain")


def train(layout: RunLayout, before_step=None, claim: run_lock.Claim | None = None) -> list[dict[str, float]]:
    """Runs the training `layout` resolved (dtrain.planner.advice.resolve_run); returns every
    step's scalars (the loss on every rank). A CUDA out-of-memory error becomes a report of this
    rank's predicted memory and the nearest layout the planner says fits. `claim`: rank 0's lock
    of the run directory when the caller took it (`run_lock.take`)."""
    t = layout.config.train
    run_dir = Path(t.run_dir)
    watching = t.step_timeout > 0
    beat, watchdog = Heartbeat(int(os.environ.get("RANK", "0"))), None
    # A failure is recorded in the run directory only where this run holds it: by rank 0's claim
    # before the process group exists, by every rank once they agree on the lock.
    holds_run_dir = claim is not None and claim.held
    # Until the checkpointer takes SIGTERM over (it saves at the next step boundary), and once it
    # gives it back, a SIGTERM ends the run through the error path: the failure is recorded.
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated) if _in_main_thread() else None
    try:
        # Collectives wait GRACE_S longer than the watchdog's limit, so that the watchdog names
        # the ranks the job waits for before a collective times out.
        runtime = distributed.init_process_group(t.init_timeout + (GRACE_S if watching else 0.0), run_dir)
        # The lock before anything else: a second run in this directory stops before writing there.
        claim = run_lock.agree(run_dir, runtime.rank, runtime.world_size, claim, functools.partial(
            run_directory.check, run_dir, resume=t.resume, overwrite=t.overwrite))
        holds_run_dir = True
        if runtime.is_main:
            run_directory.clear(run_dir, resume=t.resume, overwrite=t.overwrite)
        if watching:
            watchdog = Watchdog(beat, open_board(runtime.rank, runtime.world_size, fallback=True), run_dir=run_dir,
                                world_size=runtime.world_size, init_timeout=t.init_timeout,
                                step_timeout=t.step_timeout)
            watchdog.start()
        with log_file(run_dir / "train.log", runtime.is_main):
            if runtime.is_main:
                for choice in layout.chosen:
                    logger.info("%s", choice.line())
            scalars = Trainer(layout, runtime, heartbeat=beat, watchdog=watchdog).fit(before_step)
    except BaseException as error:
        if _in_main_thread():
            # The run is ending: torchrun's SIGTERM (it follows a peer's death within a fraction
            # of a second) must not cut the failure's record short with an exception of its own.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failure = _record_failure(error, run_dir, beat, watchdog) if holds_run_dir else None
        distributed.shutdown(after_error=True)
        if isinstance(error, torch.OutOfMemoryError):
            raise UserError(advice.out_of_memory_report(layout, beat.rank, error)) from None
        if failure is not None:
            raise failure from error
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        if claim is not None:
            claim.release()  # after the failure is recorded: the directory is ours until then
    distributed.shutdown()
    return scalars


def _raise_terminated(signum, frame) -> None:
    raise failures.Terminated("SIGTERM (torchrun stops the workers when one fails; or the scheduler)")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _record_failure(error: BaseException, run_dir: Path, beat: Heartbeat,
                    watchdog: Watchdog | None) -> failures.JobFailure | None:
    """Writes the failure into the run directory (a restart reads it); returns the one-line error
    to raise instead of `error` where that line says more: a hang (the watchdog's report) and a
    lost peer (a connection closed or a collective timed out). A Ctrl-C is no failure."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return None
    if watchdog is not None and watchdog.report is not None:
        return failures.JobFailure(watchdog.report)  # recorded by the watchdog
    lost = watchdog.lost_peers() if watchdog is not None else ("", "")
    failure = failures.from_error(error, beat.rank, beat.step, beat.current, lost=lost)
    failures.record(run_dir, failure)
    return failures.JobFailure(failure.what) if failure.kind == "lost" else None
