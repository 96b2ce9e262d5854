"""Runs the real CLI in one or several CPU processes (torchrun, gloo) and reads back its
TensorBoard scalars."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tools.compare_runs import read_scalars

REPO = Path(__file__).resolve().parent.parent

# The CPU-test shape every parity test shares (the reference command).
TINY_ARGS = ["--model", "tiny", "--steps", "10", "--seed", "0", "--precision", "fp32", "--seq-len", "64",
             "--global-batch", "8", "--micro-batch", "2", "--lr", "1e-3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args: list[str], nproc: int = 1, module: str = "dtrain.run",
            timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` (under torchrun for nproc > 1) with `env` added to the environment."""
    # The repo first, then whatever the caller's path had (packages installed beside the system's).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar series in the run's TensorBoard files, in step order."""
    return {tag: [value for _, value in sorted(by_step.items())] for tag, by_step in read_scalars(run_dir).items()}


def train_scalars(run_dir: Path, extra: list[str], nproc: int = 1,
                  env: dict[str, str] | None = None) -> dict[str, list[float]]:
    result = run_cli([*TINY_ARGS, "--run-dir", str(run_dir), *extra], nproc=nproc, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return scalars(run_dir)
