"""Workers that die with their torchrun agent.

When the agent is SIGKILLed (an OOM kill, a scheduler's hard kill, `kill -9` on a stuck job) its
workers would be re-parented and train on: they keep writing checkpoints into the run directory
while the job, restarted by a scheduler, starts new workers on the same files. Linux delivers a
chosen signal to a process when its parent dies (prctl PR_SET_PDEATHSIG); a worker asks for
SIGKILL. Checkpoints are committed atomically, so a kill at any moment loses only the steps since
the last save.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """SIGKILL this process when its parent dies; True where the system supports it (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the request: nobody will send the signal
        os.kill(os.getpid(), signal.SIGKILL)
    return True
