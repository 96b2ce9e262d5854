"""`python -m dtrain.run --nproc-per-node N`: the ranks of one machine started by dtrain itself, so
that a failed run ends in one line per failure (the rank's own, or the launcher's for a rank that
died without a word) and not in torchrun's report; a run that goes well, and a restart, read as
under torchrun."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.launch import REPO, TINY_ARGS, cli_env


ARGS = [*TINY_ARGS, "--steps", "3", "--global-batch", "4"]


def _launch(args: list[str], **env: str) -> tuple[int, str]:
    """`python -m dtrain.run --nproc-per-node 2 ARGS`, OMP_NUM_THREADS unset as a user's shell
    leaves it: (exit code, stdout and stderr)."""
    environment = {key: value for key, value in cli_env(env).items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-m", "dtrain.run", "--nproc-per-node", "2", *args], cwd=REPO,
                            env=environment, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def _nothing_of_torchrun(output: str) -> None:
    for text in ("Traceback", "ChildFailedError", "OMP_NUM_THREADS", "closing signal", "exitcode"):
        assert text not in output, output[-3000:]


@pytest.mark.slow
def test_an_option_that_fails_on_the_ranks_is_one_line(tmp_path):
    code, output = _launch(["--model", "tiny", "--mesh", "tp=3", "--run-dir", str(tmp_path / "run")])
    assert code == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "dtrain: error:" in line]
    assert errors == ["dtrain: error: --mesh 'tp=3' needs a multiple of 3 ranks but the world size is 2; change "
                      "the mesh or the number of processes"], output[-3000:]
    _nothing_of_torchrun(output)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_in_one_line(tmp_path):
    code, output = _launch([*ARGS, "--run-dir", str(tmp_path / "run")], DTRAIN_FAULT="crash@rank1:step2")
    assert code == 128 + 9, output[-3000:]
    said = [line for line in output.splitlines() if "SIGKILL" in line]
    assert said == ["dtrain: error: rank 1 died with SIGKILL; the other ranks were stopped"], output[-3000:]
    _nothing_of_torchrun(output)


@pytest.mark.slow
def test_two_ranks_train_and_say_how_to_continue_with_the_same_launcher(tmp_path):
    run_dir = tmp_path / "run"
    code, output = _launch([*ARGS, "--run-dir", str(run_dir)])
    assert code == 0, output[-3000:]
    assert "step 3/3 | loss" in output and "world 2" in output, output[-3000:]
    assert f"continue:    python -m dtrain.run --nproc-per-node 2 --config {run_dir / 'config.toml'} --resume " \
           f"--steps 6" in output, output[-3000:]
    _nothing_of_torchrun(output)


@pytest.mark.slow
def test_max_restarts_starts_every_rank_again_from_the_latest_checkpoint_in_one_line(tmp_path):
    code, output = _launch(["--max-restarts", "1", *ARGS, "--checkpoint-every", "1", "--resume", "auto",
                            "--run-dir", str(tmp_path / "run")], DTRAIN_FAULT="crash@rank1:step2")
    assert code == 0, output[-3000:]
    # The kill is named, unless rank 0's line about losing rank 1 reached the agent in the same poll.
    said = [line for line in output.splitlines() if "every rank starts again" in line]
    assert len(said) == 1 and re.fullmatch(r"dtrain: (rank 1 died with SIGKILL; )?every rank starts again "
                                           r"\(restart 1 of 1\)", said[0]), output[-3000:]
    assert "resumed from" in output and "step 3/3 | loss" in output, output[-3000:]
    _nothing_of_torchrun(output)
