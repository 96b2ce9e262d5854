"""A disk that fills up during a save: one line that says so, the previous checkpoint stays the
latest, nothing of the failed save is left to block a restart, and the restart goes on once the
space is back. On a real full device (a small tmpfs in a private mount namespace, where this
process may mount one), and, everywhere, through a writer that fails with ENOSPC at a chosen
tensor."""

from __future__ import annotations

import errno
import os

from dtrain.checkpoint import integrity


def test_the_write_check_on_a_full_disk_says_so_and_leaves_no_probe(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(integrity.os, "write", full)
    problem = integrity.write_problem(tmp_path)
    assert problem is not None and problem.startswith("no space is left on its device"), problem
    assert list(tmp_path.iterdir()) == []
