"""What srun runs on each node: appends this node's output to RUN_DIR/logs/node_NNN.log (one file
per node, kept across requeues, each start under a header line) and becomes the given command."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from pathlib import Path


def log_path(log_dir: Path, node: int) -> Path:
    return Path(log_dir) / f"node_{node:03d}.log"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.launch node")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    node = int(os.environ.get("SLURM_NODEID", "0"))
    path = log_path(args.log_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    header = (f"=== node {node} ({socket.gethostname()}) of job {os.environ.get('SLURM_JOB_ID', '?')}, "
              f"requeue {os.environ.get('SLURM_RESTART_COUNT', '0')}, started "
              f"{datetime.datetime.now().isoformat(timespec='seconds')}: {' '.join(command)}\n")
    os.write(fd, header.encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.execvp(command[0], command)  # returns only by raising
