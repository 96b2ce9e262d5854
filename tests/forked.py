"""Runs the CLI's ranks as processes forked from a server that has imported torch and dtrain
once, instead of a fresh interpreter (and a torchrun agent) per rank: each import of torch costs a
few CPU-seconds, most of what a tiny multi-rank run takes on a CI machine.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), runs the module as
`__main__` with its stdout and stderr in files of its own, and the launcher stops the others as
torchrun does when one fails (SIGTERM, then SIGKILL after a grace period). Runs that need what
only a real interpreter gives (torchrun's agent and restarts, allocator variables read at start,
inductor's compile workers) keep the subprocess path in tests/launch.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TERMINATE_GRACE_S = 30  # torchrun's own wait between SIGTERM and SIGKILL
# Variables read when an interpreter or its allocator starts: a forked rank could not honour them.
START_TIME_VARIABLES = ("MALLOC_", "PYTHONMALLOC", "PYTHONFAULTHANDLER", "LD_", "OMP_", "MKL_")

_context = None


def can_run(args: list[str], env: dict[str, str]) -> bool:
    """Whether a forked rank behaves as a fresh interpreter would. Not with variables read at
    start, and not under --compile: inductor's compile workers, started from a forked rank, made a
    two-rank compiled run spin for minutes where a fresh interpreter took one."""
    return "--compile" not in args and not any(name.startswith(START_TIME_VARIABLES) for name in env)


def _server():
    global _context
    if _context is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the server's environment is every rank's base
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["tests.forked_preload"])
    return _context


def _rank_main(module: str, args: list[str], env: dict[str, str], out: str, err: str) -> None:
    for stream, path in ((1, out), (2, err)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, stream)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    import faulthandler

    faulthandler.enable()  # a rank that dies on a signal leaves its Python stack in its stderr
    os.environ.update(env)
    os.chdir(REPO)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import runpy

    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(module: str, args: list[str], nproc: int, env: dict[str, str], timeout: float,
        master_port: int) -> subprocess.CompletedProcess:
    """The ranks' exit, and their stdout and stderr in rank order, as one CompletedProcess: the
    first failing rank's code (1 for a failure of several ranks, as torchrun), else 0."""
    context = _server()
    with tempfile.TemporaryDirectory(prefix="dtrain-ranks-") as folder:
        ranks = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
            process = context.Process(target=_rank_main, args=(module, args, rank_env, f"{folder}/{rank}.out",
                                                                 f"{folder}/{rank}.err"), daemon=True)
            process.start()
            ranks.append(process)
        code = _supervise(ranks, timeout)
        out, err = (_read_all(Path(folder), nproc, suffix) for suffix in ("out", "err"))
    command = [sys.executable, "-m", module, *args]
    if code is None:
        raise subprocess.TimeoutExpired(command, timeout, out, err)
    return subprocess.CompletedProcess(command, code, out, err)


def _read_all(folder: Path, nproc: int, suffix: str) -> str:
    """The ranks' output in rank order ("" for a rank that died before it opened its file)."""
    paths = [folder / f"{rank}.{suffix}" for rank in range(nproc)]
    return "".join(path.read_text(errors="replace") for path in paths if path.exists())


def _supervise(ranks: list, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [process.exitcode for process in ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            break
        if time.monotonic() > deadline:
            _stop(ranks)
            return None
        time.sleep(0.02)
    if failed:
        _stop(ranks)
        return failed[0] if len(ranks) == 1 else 1
    return 0


def _stop(ranks: list) -> None:
    for process in ranks:
        if process.exitcode is None:
            process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()
