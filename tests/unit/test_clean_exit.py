"""A run that ends leaves nothing running behind it: no process group outlives the shutdown. A
gloo group still alive when the interpreter finalizes destroys its workers' last work then, which
takes the GIL of an interpreter being torn down and aborts a run that succeeded ("terminate called
without an active exception", SIGABRT; seen once in 49 resumes with no step left)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtrain.run import main
from tests.launch import TINY_ARGS


def _gloo_threads() -> set[str]:
    """The threads of this process that gloo process groups run (their workers and transport loops),
    by thread id: a group an earlier test left behind may be freed during the run, so only the
    threads the run started are compared."""
    tasks = Path("/proc/self/task")
    return {task for task in os.listdir(tasks) if (tasks / task / "comm").read_text().startswith(("pt_gloo", "gloo_"))}


@pytest.mark.parametrize("extra", [[], ["--async-checkpoint"]], ids=["sync saves", "async saves"])
def test_no_process_group_outlives_a_run(tmp_path, extra):
    before = _gloo_threads()
    args = [*TINY_ARGS, "--steps", "2", "--run-dir", str(tmp_path), "--checkpoint-every", "2", *extra]
    assert main(args) == 0
    assert not _gloo_threads() - before, "a process group of the run is still alive"
    assert main([*args, "--resume"]) == 0  # no step left: the last collectives are the load's
    assert not _gloo_threads() - before, "a process group of the resumed run is still alive"
