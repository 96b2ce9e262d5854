"""A run that ends leaves nothing running behind it: no process group outlives the shutdown. A
gloo group still alive when the interpreter finalizes destroys its workers' last work then, which
takes the GIL of an interpreter being torn down and aborts a run that succeeded ("terminate called
without an active exception", SIGABRT; seen once in 49 resumes with no step left)."""

from __future__ import annotations

import pytest

from tests.launch import TINY_ARGS, run_cli


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("extra", [[], ["--async-checkpoint"]], ids=["sync saves", "async saves"])
def test_resumes_with_no_step_left_exit_cleanly_every_time(tmp_path, extra):
    """Two ranks in fresh interpreters (the interpreter's exit is the point), 40 times."""
    args = [*TINY_ARGS, "--steps", "2", "--run-dir", str(tmp_path), "--checkpoint-every", "2", *extra]
    env = {"DTRAIN_TEST_LAUNCHER": "subprocess"}
    assert run_cli(args, nproc=2, env=env).returncode == 0
    for attempt in range(40):
        result = run_cli([*args, "--resume"], nproc=2, env=env)
        output = result.stdout + result.stderr
        assert result.returncode == 0 and "terminate called" not in output, (attempt, output[-3000:])
