"""The commit a measurement ran at, for every JSON line the benchmark tools write: `DTRAIN_COMMIT`
where set (a machine that has the working tree but not its git history), else git's short hash."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def commit_hash() -> str:
    if os.environ.get("DTRAIN_COMMIT"):
        return os.environ["DTRAIN_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
