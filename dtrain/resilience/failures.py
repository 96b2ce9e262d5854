"""The failures of a job, and the end of a restart loop that would only repeat one.

A rank that fails appends one JSON line to RUN_DIR/failures/rank_NNNNN.jsonl: the attempt (SLURM's
requeue count, torchrun's restart count), the step and phase it was in, what happened, and a key
that names the failure without its volatile numbers (ports, pids, sizes):

    {"attempt": [0, 1], "rank": 0, "step": 5, "phase": "forward", "kind": "lost",
     "what": "rank 1 (pid 4242, step 5, data) exited ...", "key": "lost ranks 1", ...}

When a restarted job starts, rank 0 compares the last two failed attempts: the same kind of
failure with the same key at the same step means the next attempt would fail again (an OOM at
that step, a bad sample, a rank that crashes there), so the job stops with one line instead of
spending its restarts. A fresh start (neither restarted by torchrun nor requeued) begins a new
record and keeps the previous one in RUN_DIR/failures.previous/. Nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import attrs

logger = logging.getLogger("dtrain")

FAILURES = "failures"
# Which of an attempt's records tells what happened: a rank's own error causes the lost
# connections its peers see, and a hang report names the rank the others waited for.
KIND_ORDER = ("error", "hang", "lost")
# Whole words where a word could hide inside another ("TypeError" holds "peEr").
_COMMUNICATION = re.compile(r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out|"
                            r"processgroup|socket|\bpeers?\b", re.IGNORECASE)
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\d+")


class JobFailure(RuntimeError):
    """The job failed (not the user's input): one line that says what happened and what to do."""


class Terminated(BaseException):
    """SIGTERM where the run cannot save: torchrun stopping the workers after one of them failed,
    or a scheduler ending the job while it starts. (A BaseException, like KeyboardInterrupt: no
    `except Exception` on the way may swallow it.)"""


def attempt() -> tuple[int, int]:
    """(times SLURM requeued the job, times torchrun restarted its workers)."""
    return (int(os.environ.get("SLURM_RESTART_COUNT") or 0), int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0))


@attrs.frozen
class Failure:
    rank: int
    step: int
    phase: str
    kind: str  # one of KIND_ORDER
    what: str  # one line for people
    key: str  # equal for the same failure in another attempt
    attempt: tuple[int, int] = attrs.field(factory=attempt, converter=tuple)
    time: float = attrs.field(factory=time.time)


def volatile_free(text: str) -> str:
    return _VOLATILE.sub("#", text)


def from_error(error: BaseException, rank: int, step: int, phase: str, lost: tuple[str, str] = ("", "")) -> Failure:
    """The failure an exception stands for. A communication error is a lost peer: `lost` is
    (what, key) of the peers found gone or frozen when known, else the error's own words stand."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    described = f"{type(error).__name__}: {first}" if first else type(error).__name__
    where = f"rank {rank} at step {step} ({phase})"
    names = {cls.__name__ for cls in type(error).__mro__}
    if "UserError" in names:  # a refused input, whatever its words: said as it is, never a lost peer
        return Failure(rank, step, phase, "error", f"{where}: {first}", volatile_free(described))
    if names & {"Terminated", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError"} \
            or _COMMUNICATION.search(first):
        lost_what, lost_key = lost
        if lost_what:
            what = f"{where} lost its peers: {lost_what}"
        elif "Terminated" in names:
            what = f"{where} was stopped by SIGTERM (torchrun stopping the workers after another failed, or the scheduler)"
        else:
            what = f"{where} lost its peers ({described})"
        return Failure(rank, step, phase, "lost", what, f"lost: {lost_key or volatile_free(described)}")
    return Failure(rank, step, phase, "error", f"{where}: {described}", volatile_free(described))


def record(run_dir: Path, failure: Failure) -> bool:
    """Appends `failure` to this rank's file (one writer per file: safe on any shared filesystem);
    False, with a warning, where the run directory takes no writes (the failure is still raised)."""
    folder = Path(run_dir) / FAILURES
    line = json.dumps(attrs.asdict(failure)) + "\n"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank_{failure.rank:05d}.jsonl", "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        logger.warning("could not record the failure in %s: %s", folder, error)
        return False
    return True


def read(run_dir: Path) -> list[Failure]:
    """Every recorded failure of the current record, oldest first (unreadable lines are skipped:
    a process killed while writing leaves at most its last line half written)."""
    failures = []
    folder = Path(run_dir) / FAILURES
    for path in sorted(folder.glob("rank_*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text(errors="replace").splitlines():
            try:
                failures.append(_parse(json.loads(line)))
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
    return sorted(failures, key=lambda f: (f.attempt, f.time))


def _parse(fields: dict) -> Failure:
    if fields["kind"] not in KIND_ORDER:
        raise ValueError(fields["kind"])
    return Failure(int(fields["rank"]), int(fields["step"]), str(fields["phase"]), fields["kind"], str(fields["what"]),
                   str(fields["key"]), tuple(int(a) for a in fields["attempt"]), float(fields["time"]))


def cause(failures: list[Failure]) -> Failure:
    """The record of one attempt that tells what happened."""
    return min(failures, key=lambda f: (KIND_ORDER.index(f.kind), f.time))


def repeated(failures: list[Failure]) -> tuple[Failure, Failure] | None:
    """The causes of the last two failed attempts when they are the same failure at the same step."""
    by_attempt: dict[tuple, list[Failure]] = {}
    for failure in failures:
        by_attempt.setdefault(tuple(failure.attempt), []).append(failure)
    if len(by_attempt) < 2:
        return None
    before, last = (cause(by_attempt[a]) for a in sorted(by_attempt)[-2:])
    if (before.step, before.kind, before.key) == (last.step, last.kind, last.key):
        return before, last
    return None


def check_start(run_dir: Path) -> None:
    """Rank 0, as a job starts: a fresh start sets the previous record aside; a restart after two
    attempts that failed the same way at the same step raises JobFailure instead of running a third."""
    folder = Path(run_dir) / FAILURES
    if attempt() == (0, 0):
        if folder.is_dir():
            previous = folder.with_name(FAILURES + ".previous")
            shutil.rmtree(previous, ignore_errors=True)
            folder.rename(previous)
        return
    same = repeated(read(run_dir))
    if same is not None:
        _, last = same
        raise JobFailure(f"the job failed the same way in two attempts in a row, at step {last.step}: {last.what}; "
                         f"another restart would fail again, so the job stops here: fix the cause and start it "
                         f"again (every failure is in {folder}/)")
