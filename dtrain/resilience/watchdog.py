"""Hang detection: a thread on every rank that publishes its heartbeat and notices when its own
training thread stops making progress, then names the ranks the job waits for.

    watch = Watchdog(beat, board, run_dir=..., world_size=2, init_timeout=600, step_timeout=120)
    watch.start()
    watch.adopt_groups(groups)    # these process groups follow the watchdog's limit
    watch.relax(until_step=s + 1) # a save at step s: long limits until step s + 1 is read back
    watch.step_done(s)            # after a step's read-back: short limits again when due

A phase (heartbeat.PHASES) may last `--step-timeout` seconds once steps run, `--init-timeout`
while the run starts (building, loading, compiling: the first step included), saves, evaluates,
and during the step after a save (rank 0 may still commit and prune while the others wait).
Collectives time out `GRACE_S` later than the watchdog's limit, so the watchdog speaks first:

1. the first rank to notice reads every rank's heartbeat and names those that stopped
   publishing (frozen or gone: `hang@rank1:step5` is a SIGSTOP) and those behind the others;
   each rank logs one line, writes its Python stacks to RUN_DIR/hangs/rank_N.txt and, on GPUs,
   NCCL's flight recorder to RUN_DIR/flight_recorder/rank_N;
2. ranks on its own node that stopped publishing are SIGKILLed: a frozen process cannot take
   the SIGTERM with which torchrun stops workers (it would wait 30 s before its SIGKILL);
3. the stuck collective then fails (at once when its peer is gone, else after GRACE_S: NCCL
   dumps its flight recorder into RUN_DIR/flight_recorder then) and the run exits with the
   report as its error; a rank still alive 2 x GRACE_S after its report exits itself.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dtrain import distributed
from dtrain.resilience import failures
from dtrain.resilience.heartbeat import LONG_PHASES, PHASES, Board, Heartbeat

logger = logging.getLogger("dtrain")

GRACE_S = 20.0
# After a SIGTERM the run saves at its next step boundary. A rank that has not reached one this
# long after the signal waits in a collective for a peer that is gone (NCCL notices no dead peer):
# it records why and exits before torchrun's SIGKILL, 30 s after its SIGTERM, leaves no trace.
TERM_GRACE_S = 25.0
CLOSE_TIMEOUT_S = 35.0  # longer than a store call of the board can take (heartbeat.open_board: 30 s)
HANGS = "hangs"  # under the run directory: each rank's Python stacks at a hang
MAX_PLACES = 4  # (step, phase) groups of waiting ranks a report lists


def poll_interval(step_timeout: float) -> float:
    """How often the heartbeat is published and progress checked: a tenth of the step timeout
    (so a hang is named within 10% of it), at most every 5 s."""
    return min(5.0, max(0.2, step_timeout / 10))


def format_ranks(ranks) -> str:
    """`rank 3`, `ranks 0-3, 6`."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def diagnose(beats: dict[int, dict | None], now: float, stale_after: float) -> tuple[str, str]:
    """(one line naming where every rank is, a key naming who the job waits for) from the ranks'
    last heartbeats: those that stopped publishing first, then those behind the rest."""
    missing = [rank for rank, beat in beats.items() if beat is None]
    stopped = {rank: beat for rank, beat in beats.items() if beat is not None and now - beat["beat"] > stale_after}
    alive = {rank: beat for rank, beat in beats.items() if beat is not None and rank not in stopped}
    parts, culprits = [], []
    if missing:
        parts.append(f"{format_ranks(missing)} never reported a heartbeat")
        culprits.append(f"missing {format_ranks(missing)}")
    # Every rank joins a collective at the end of each step: ranks alive in step s passed the end
    # of step s - 1, and so did a rank that froze since. Its own last beat, published up to a poll
    # before it froze, can be steps older than that where steps are fast.
    passed = min((beat["step"] for beat in alive.values()), default=0) - 1
    for (step, phase), ranks in _by_place(stopped).items():
        silent = max(now - stopped[r]["beat"] for r in ranks)
        if 1 <= passed and step <= passed:
            parts.append(f"{format_ranks(ranks)} stopped responding in step {passed + 1} or at the end of step "
                         f"{passed} (its last heartbeat, {silent:.0f} s old, is from step {step} ({phase})): the "
                         f"process is frozen or gone")
            culprits.append(f"stopped {format_ranks(ranks)}")
            continue
        parts.append(f"{format_ranks(ranks)} stopped responding in step {step} ({phase}) or just after: no "
                     f"heartbeat for {silent:.0f} s, the process is frozen or gone")
        culprits.append(f"stopped {format_ranks(ranks)} at {phase}")
    places = _by_place(alive)
    if len(places) > 1 and not culprits:
        (step, phase), behind = min(places.items(), key=lambda item: (item[0][0], PHASES.index(item[0][1])))
        parts.append(f"{format_ranks(behind)} still in {phase} of step {step}, behind the others")
        culprits.append(f"behind {format_ranks(behind)} at {phase}")
        del places[(step, phase)]
    for (step, phase), ranks in list(places.items())[:MAX_PLACES]:
        parts.append(f"{format_ranks(ranks)} wait{'s' if len(ranks) == 1 else ''} in {phase} of step {step}")
    if len(places) > MAX_PLACES:
        parts.append(f"{sum(len(r) for r in list(places.values())[MAX_PLACES:])} more ranks elsewhere")
    if not culprits:
        parts.append("no rank is behind: a collective does not complete (a network or NCCL problem; NCCL's flight "
                     "recorder dumps go to RUN_DIR/flight_recorder), or the phase is slower than its timeout")
        culprits.append("collective")
    return "; ".join(parts), "; ".join(culprits)


def _by_place(beats: dict[int, dict]) -> dict[tuple[int, str], list[int]]:
    places: dict[tuple[int, str], list[int]] = {}
    for rank, beat in sorted(beats.items()):
        places.setdefault((beat["step"], beat["phase"]), []).append(rank)
    return places


def process_state(pid: int, ppid: int) -> str:
    """`running`, `stopped` or `exited` for a sibling worker (`ppid`: the parent they share; a pid
    now used by another process counts as exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "exited"
    state, parent = fields[0], int(fields[1])
    if state in "ZX" or parent != ppid:
        return "exited"
    return "stopped" if state in "Tt" else "running"


class Watchdog:
    """See the module docstring. `exit_process` is False only in tests of the report."""

    def __init__(self, heartbeat: Heartbeat, board: Board, *, run_dir: Path, world_size: int,
                 init_timeout: float, step_timeout: float, exit_process: bool = True):
        self.beat, self.board, self.run_dir = heartbeat, board, Path(run_dir)
        self.world_size, self.init_timeout, self.step_timeout = world_size, init_timeout, step_timeout
        self.exit_process = exit_process
        self.poll = poll_interval(step_timeout)
        # A beat older than this is a frozen or dead rank (beats come every `poll` seconds; the
        # floor absorbs the clocks of different hosts disagreeing by a few seconds).
        self.stale_after = max(3 * self.poll, min(10.0, step_timeout / 2))
        # Long limits until this step is read back; -1: short ones. Until `starting_at`, long.
        self.relaxed_until: float = math.inf
        self.report: str | None = None
        self.groups: list = []
        self.set_collective_timeout: Callable[[float, list], None] = lambda seconds, groups: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtrain-watchdog", daemon=True)
        self._publish_failed = False
        self._warned_slow_steps = False
        self.terminating: Callable[[], bool] = lambda: False  # a SIGTERM asked the run to save and stop
        self._terminated_at: float | None = None

    # ---- the training thread's side ---------------------------------------------------------

    def start(self) -> None:
        self._publish()  # every rank has a beat on the board before any step runs
        self._thread.start()

    def close(self) -> None:
        """Stops the watchdog thread and waits for it. A daemon thread still inside a store call
        when the interpreter exits aborts the process ("terminate called without an active
        exception": it takes the GIL back during finalization), after a run that succeeded."""
        self._stop.set()
        # Not a thread that ends the process itself (after a hang report or a SIGTERM), and one
        # that is in a store call whose host is gone only up to the store's timeout.
        ending = self.report is not None or self._terminated_at is not None
        if self._thread.is_alive() and not ending and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
        # The process groups, and the trainer that `terminating` reaches, must not outlive the run
        # through this object (see distributed.shutdown).
        self.groups, self.set_collective_timeout = [], lambda seconds, groups: None
        self.terminating = lambda: False

    def adopt_groups(self, groups: list, set_collective_timeout: Callable[[float, list], None]) -> None:
        """The process groups whose collective timeout follows the limit (a background save's
        group keeps its own), and how to set it; applies the current limit."""
        self.groups, self.set_collective_timeout = groups, set_collective_timeout
        self._apply()

    def starting_at(self, step: int) -> None:
        """Steps run from `step` on: the first of them (compilation) still runs under the long limit."""
        self.relaxed_until = step + 1
        self._apply()

    def relax(self, until_step: float) -> None:
        """Long limits until step `until_step` is read back (math.inf: until the run ends)."""
        self.relaxed_until = max(self.relaxed_until, until_step)
        self._apply()

    def step_done(self, step: int, seconds: float) -> None:
        """Step `step` was read back after `seconds` (rank 0 warns when steps come near the limit)."""
        if 0 <= self.relaxed_until <= step:
            self.relaxed_until = -1
            self._apply()
        elif self.relaxed_until < 0 and seconds > self.step_timeout / 2 and not self._warned_slow_steps:
            self._warned_slow_steps = True
            if self.beat.rank == 0:
                logger.warning("step %d took %.0f s, more than half of --step-timeout %g: raise it, or a slower "
                               "step will be reported as a hang", step, seconds, self.step_timeout)

    def limit(self) -> float:
        relaxed = self.relaxed_until >= 0 or self.beat.current in LONG_PHASES
        return self.init_timeout if relaxed else self.step_timeout

    def _apply(self) -> None:
        long = self.relaxed_until >= 0
        self.set_collective_timeout((self.init_timeout if long else self.step_timeout) + GRACE_S, self.groups)

    # ---- the watchdog thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self._publish()
            if self._terminated_too_long():
                self._end_terminated()
                return
            stuck = self.beat.stuck_for()
            if stuck > self.limit():
                try:
                    self._report(stuck)
                except Exception as error:  # a report that fails must not keep a hung rank alive
                    self.report = f"hang: rank {self.beat.rank} made no progress for {stuck:.0f} s ({error})"
                    logger.error(self.report)
                self._end()
                return

    def _terminated_too_long(self) -> bool:
        """After a SIGTERM: a worker of this node already gone means torchrun is stopping the job
        (no save can complete: end now); otherwise allow TERM_GRACE_S to reach a step boundary."""
        if self._terminated_at is None:
            if not self.terminating():
                return False
            self._terminated_at = time.monotonic()
            return bool(self.lost_peers()[0])
        return self.beat.current != "checkpoint" and time.monotonic() - self._terminated_at > TERM_GRACE_S

    def _end_terminated(self) -> None:
        failure = failures.from_error(failures.Terminated("SIGTERM, and no step boundary reached"), self.beat.rank,
                                      self.beat.step, self.beat.current, lost=self.lost_peers())
        logger.error("%s", failure.what)
        failures.record(self.run_dir, failure)
        if self.exit_process:
            logging.shutdown()
            os._exit(143)

    def _publish(self) -> None:
        try:
            self.board.publish(self.beat.record())
        except Exception as error:  # the store's host is gone: the job is ending anyway
            if not self._publish_failed:
                logger.warning("heartbeat: cannot publish to the job's store (%s)", error)
            self._publish_failed = True

    def _report(self, stuck: float) -> None:
        """Sets `report` (the training thread raises it as its error), records the failure, writes
        the stacks, and kills the frozen siblings: last, since their death fails the collective."""
        step, phase = self.beat.step, self.beat.current
        own = f"rank {self.beat.rank} made no progress for {stuck:.0f} s in {phase} of step {step}"
        kind, key = "hang", f"no progress in {phase}"
        try:
            if self.world_size == 1:
                line = f"hang: {own}"
            elif self.board.claim("hang"):
                found, key = diagnose(self.board.read(range(self.world_size)), time.time(), self.stale_after)
                line = f"hang: {found}"
            else:  # the reporting rank names the culprits; this one only waited for them
                line, kind = f"hang: {own}; another rank reports who the job waits for", "lost"
                key = f"waited in {phase} for a hang"
        except Exception as error:
            line = f"hang: {own} (the heartbeats are unreadable: {error})"
        logger.error("%s; Python stacks: %s%s", line, self._dump_stacks(), self._dump_flight_recorder())
        failures.record(self.run_dir, failures.Failure(self.beat.rank, step, phase, kind, line, key))
        # Set once the record is on disk: the training thread raises the report, and a restart
        # that read the failures before the record was written would not see this hang.
        self.report = line
        self._kill_frozen_siblings()

    def _dump_stacks(self) -> Path:
        folder = self.run_dir / HANGS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank_{self.beat.rank:05d}.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        return path

    def _dump_flight_recorder(self) -> str:
        try:
            path = distributed.dump_flight_recorder(self.beat.rank)
        except Exception as error:  # the report matters more than the dump
            return f"; no flight recorder dump ({error})"
        return f"; NCCL flight recorder: {path}" if path else ""

    def _kill_frozen_siblings(self) -> None:
        """Workers of this node (children of the same torchrun agent) whose heartbeat went stale."""
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        first = self.beat.rank - int(os.environ.get("LOCAL_RANK", "0"))
        siblings = [r for r in range(first, first + local_size) if r != self.beat.rank]
        try:
            beats = self.board.read(siblings)
        except Exception:
            return
        now = time.time()
        for rank, beat in beats.items():
            if beat is None or now - beat["beat"] <= self.stale_after or beat["ppid"] != self.beat.ppid:
                continue
            if process_state(beat["pid"], beat["ppid"]) != "exited":
                logger.error("hang: killing rank %d (pid %d): frozen, it cannot take torchrun's SIGTERM",
                             rank, beat["pid"])
                os.kill(beat["pid"], signal.SIGKILL)

    def _end(self) -> None:
        """Waits for the training thread's stuck collective to fail (see the module docstring): it
        times out GRACE_S after the report, and NCCL then dumps its flight recorder and aborts the
        process; another GRACE_S leaves that dump the time to finish."""
        if not self.exit_process:
            return
        time.sleep(2 * GRACE_S if self.world_size > 1 else 0)
        logging.shutdown()
        os._exit(1)

    def lost_peers(self) -> tuple[str, str]:
        """(what, key) of the workers of this node that exited or froze, for the error of a failed
        collective; ("", "") when none did (remote ranks are named by the hang report of whichever
        rank sees the hang first). The key leaves out what depends on timing (pids, last phase)."""
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        first = self.beat.rank - int(os.environ.get("LOCAL_RANK", "0"))
        try:
            beats = self.board.read(r for r in range(first, first + local_size) if r != self.beat.rank)
        except Exception:
            return "", ""
        gone, keys = [], []
        for rank, beat in sorted(beats.items()):
            if beat is not None and beat["ppid"] == self.beat.ppid:
                state = process_state(beat["pid"], beat["ppid"])
                if state != "running":
                    state = "exited" if state == "exited" else "is frozen"
                    gone.append(f"rank {rank} (pid {beat['pid']}, last heard of in step {beat['step']}, "
                                f"{beat['phase']}) {state}")
                    keys.append(f"rank {rank} {state}")
        return "; ".join(gone), "; ".join(keys)
