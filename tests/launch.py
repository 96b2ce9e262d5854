"""Runs the real CLI in one or several CPU processes (torchrun, gloo) and reads back its
TensorBoard scalars."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests import forked
from tools.compare_runs import read_scalars

REPO = Path(__file__).resolve().parent.parent

# The CPU-test shape every parity test shares (the reference command).
TINY_ARGS = ["--model", "tiny", "--steps", "10", "--seed", "0", "--precision", "fp32", "--seq-len", "64",
             "--global-batch", "8", "--micro-batch", "2", "--lr", "1e-3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_command(args: list[str], nproc: int = 1, module: str = "dtrain.run",
                torchrun_args: tuple[str, ...] = ()) -> list[str]:
    if nproc == 1 and not torchrun_args:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(_free_port()), *torchrun_args, "-m", module, *args]


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    # The repo first, then whatever the caller's path had (packages installed beside the system's).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}


def run_cli(args: list[str], nproc: int = 1, module: str = "dtrain.run", timeout: float = 600,
            env: dict[str, str] | None = None, torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python -m module args` (under torchrun for nproc > 1, or with `torchrun_args`) with `env`
    added to the environment. Ranks are forked from a server that has torch imported
    (tests/forked.py) unless the run needs torchrun's agent or a fresh interpreter, or
    DTRAIN_TEST_LAUNCHER=subprocess asks for the real commands."""
    if not torchrun_args and forked.can_run(args, env or {}) and os.environ.get("DTRAIN_TEST_LAUNCHER") != "subprocess":
        return forked.run(module, args, nproc, cli_env(env), timeout, _free_port())
    return subprocess.run(cli_command(args, nproc, module, torchrun_args), cwd=REPO, env=cli_env(env),
                          capture_output=True, text=True, timeout=timeout)


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar series in the run's TensorBoard files, in step order."""
    return {tag: [value for _, value in sorted(by_step.items())] for tag, by_step in read_scalars(run_dir).items()}


def train_scalars(run_dir: Path, extra: list[str], nproc: int = 1,
                  env: dict[str, str] | None = None) -> dict[str, list[float]]:
    result = run_cli([*TINY_ARGS, "--run-dir", str(run_dir), *extra], nproc=nproc, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return scalars(run_dir)
