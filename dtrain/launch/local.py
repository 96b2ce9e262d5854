"""The ranks of one machine, started by `python -m dtrain.run` itself, so that a run that fails
ends in the one line its ranks print, not in torchrun's report of its agent:

    python -m dtrain.run --nproc-per-node 8 --model llama3-8b --mesh tp=8
    python -m dtrain.run --nproc-per-node 8 --max-restarts 3 --resume auto --model llama3-8b ...

This process is then the agent that torchrun would be: torch's elastic launcher, in this process,
starts `python -m dtrain.run ARGS` once per rank (on a free local port) and, with --max-restarts,
starts every rank again after one fails. A rank that fails says why in a line of its own (exit
code 2 for a mistake, which rank 0 alone says when every rank makes it; 1 for a failure of the
job), so nothing is added; a rank killed by a signal, or one that exits with another code, is named
here in one line. Several machines start with torchrun or `python -m dtrain.launch slurm`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Any, Iterator

import attrs

from dtrain import command_line
from models.errors import UserError

NPROC, RESTARTS = command_line.LAUNCH_FLAGS  # --help shows them in its launch section
# Each flag as dtrain writes it, and as torchrun's users type it.
_SPELLINGS = {NPROC: NPROC, "--nproc_per_node": NPROC, RESTARTS: RESTARTS, "--max_restarts": RESTARTS}
# Exit codes of a rank that has said why: a UserError (2), a failure of the job or a Python
# traceback (1), a Ctrl-C (130).
EXPLAINED = (1, 2, 130)

# torch's agent lines that the ranks' own lines, or this module's, say better (matched on the
# format string, so that a line torch words otherwise is shown rather than lost).
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
_STOPPING = ("Sending process %s closing signal %s", "Received %s death signal, shutting down workers")
_FAILED = "failed (exitcode: "  # exit code, local rank, pid, command
_RESTARTING = "[%s] Worker group %s. "  # role, state, restarts left, restarts in all


def command(ranks: int) -> str:
    """The start of the command line that runs `ranks` ranks of dtrain on one machine."""
    return "python -m dtrain.run" + (f" {NPROC} {ranks}" if ranks > 1 else "")


@attrs.frozen
class Launch:
    nproc_per_node: int
    max_restarts: int = 0


def split(argv: list[str]) -> tuple[Launch | None, list[str]]:
    """(the launch asked for, or None; the other arguments). Raises UserError on a bad value."""
    values: dict[str, int] = {}
    rest: list[str] = []
    words = iter(argv)
    for word in words:
        name, equals, value = word.partition("=")
        if name not in _SPELLINGS:
            rest.append(word)
            continue
        flag = _SPELLINGS[name]
        value = value if equals else next(words, "")
        if not value.isdigit():
            raise UserError(f"{flag} needs a whole number, not {value!r}")
        values[flag] = int(value)
    if NPROC not in values:
        if RESTARTS in values:
            raise UserError(f"{RESTARTS} restarts the ranks that {NPROC} N starts: give both")
        return None, rest
    if values[NPROC] < 1:
        raise UserError(f"{NPROC} {values[NPROC]}: give at least 1 rank")
    return Launch(values[NPROC], values.get(RESTARTS, 0)), rest


def main(argv: list[str]) -> int | None:
    """What `python -m dtrain.run` does first: None where this process is itself a rank (no
    --nproc-per-node, or --help), else the run's exit code once its ranks have ended."""
    try:
        launch, rest = split(argv)
        if launch is None or command_line.wants_help(rest):
            return None
        from dtrain import distributed

        if distributed.launched_by_torchrun():
            raise UserError(f"{NPROC} starts the ranks itself, and torchrun has already started this one: leave "
                            f"out {NPROC} (and {RESTARTS}) under torchrun")
        from dtrain.config import load_config

        load_config(rest)  # the flags checked once, before any rank starts
    except UserError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dtrain: error: {error}", file=sys.stderr)
        return 2
    return run_agent(launch, rest)


def run_agent(launch: Launch, args: list[str]) -> int:
    """`python -m dtrain.run ARGS` on `launch.nproc_per_node` ranks; the exit code of the rank that
    failed first (128 + the signal for one that a signal ended), 0 when every rank finished."""
    if launch.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it, without its banner
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # One node: torchrun's c10d rendezvous on a free port of this machine.
    options = torchrun.parse_args([f"{NPROC}={launch.nproc_per_node}", f"{RESTARTS}={launch.max_restarts}",
                                   "-m", "dtrain.run", *args])
    try:
        with _agent_log(launch):
            torchrun.run(options)
    except ChildFailedError as error:
        rank, failure = _first_failure(error.failures)
        if failure.exitcode in EXPLAINED:
            return failure.exitcode  # its rank's line says why
        stopped = "; the other ranks were stopped" if launch.nproc_per_node > 1 else ""
        restarts = launch.max_restarts
        after = f", after {restarts} restart{'s' if restarts > 1 else ''}" if restarts else ""
        print(f"dtrain: error: {_ended(rank, failure.exitcode)}{stopped}{after}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
    except SignalException as error:
        # Ctrl-C or SIGTERM here: the ranks were passed the signal, and rank 0 says what they did.
        return 128 + int(error.sigval)
    return 0


def _first_failure(failures: dict) -> tuple[int, Any]:
    """(rank, ProcessFailure) of the failure that came first. The agent times failures to the
    second; of several in the same second, a rank that died unexplained goes first (its peers fail
    with lines about losing it, not the other way round), then one that said why, then one that
    the agent's own SIGTERM stopped; of equals, the one the agent saw first."""
    def order(item):
        code = item[1].exitcode
        return item[1].timestamp, 2 if code == -signal.SIGTERM else 1 if code in EXPLAINED else 0

    return min(failures.items(), key=order)


def _ended(rank: int, exitcode: int) -> str:
    if exitcode >= 0:
        return f"rank {rank} exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    return f"rank {rank} died with {name}"


class _AgentLines(logging.Filter):
    """torch's agent lines, kept to what the user needs: its notices of stopping the other ranks
    and its line for the rank that failed are dropped (the ranks' own lines, or this module's,
    say it), and a restart is one line, which names a rank that died without a word."""

    def __init__(self, shown_level: int):
        super().__init__()
        self.shown_level = shown_level  # the agent's INFO lines only where LOGLEVEL asked for them
        self.failure: tuple[int, int] | None = None  # (local rank, exit code) of the last failure

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith(_FAILED) and isinstance(record.args, tuple) and len(record.args) >= 2:
            exitcode, local_rank = record.args[:2]
            self.failure = (int(local_rank), int(exitcode))
            return False
        if text.startswith(_RESTARTING) and isinstance(record.args, tuple) and len(record.args) == 4:
            _, _, left, total = record.args
            # A rank that said why needs no more words (the agent names the one it saw first).
            unexplained = self.failure is not None and self.failure[1] not in EXPLAINED
            cause = f"{_ended(*self.failure)}; " if unexplained else ""
            print(f"dtrain: {cause}every rank starts again (restart {total - left + 1} of {total})",
                  file=sys.stderr, flush=True)
            return False
        return text not in _STOPPING and record.levelno >= self.shown_level


@contextlib.contextmanager
def _agent_log(launch: Launch) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    levels = [logger.level for logger in loggers]
    lines = _AgentLines(min(logger.getEffectiveLevel() for logger in loggers))
    for logger in loggers:
        logger.addFilter(lines)
        if launch.max_restarts:
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))  # to see the restart line
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeFilter(lines)
            logger.setLevel(level)
