"""A newcomer's first run: it ends with a checkpoint and says where it and the logs are and what to
run next; a run directory that holds another run is refused unless --resume or --overwrite."""

from __future__ import annotations

import re
import shlex

import pytest

from dtrain.checkpoint import storage as ckpt
from dtrain.run import main
from tests.launch import TINY_ARGS


ARGS = [*TINY_ARGS, "--steps", "2"]


@pytest.fixture
def run(capsys, caplog):
    """`run(run_dir, flags)`: the CLI in this process; (exit code, its log, its stderr)."""
    def run(run_dir, extra, args=ARGS) -> tuple[int, str, str]:
        caplog.clear()
        code = main([*args, "--run-dir", str(run_dir), *extra])
        return code, caplog.text, capsys.readouterr().err.strip()

    return run


def _closing(log: str) -> dict[str, str]:
    """The last lines' `name: value` pairs."""
    lines = log[log.index("run finished"):].splitlines()
    return dict(m.groups() for line in lines if (m := re.search(r"  (\w+):\s+(.+)$", line)))


def test_a_run_saves_a_final_checkpoint_and_its_last_lines_say_where_things_are_and_what_next(tmp_path, run):
    code, log, err = run(tmp_path / "run", [])
    assert code == 0, err
    final = tmp_path / "run" / ckpt.CHECKPOINTS / ckpt.checkpoint_name(2)
    assert (final / ckpt.COMPLETE).is_file()
    # Off a GPU the step line gives the run's throughput, in no GPU's unit, and no MFU.
    assert "| tok/s " in log and "GPU" not in log and "MFU" not in log, log[-3000:]
    said = _closing(log)
    assert said["checkpoint"] == str(final)
    assert said["TensorBoard"] == str(tmp_path / "run" / "tensorboard")
    assert said["log"] == str(tmp_path / "run" / "train.log")
    assert said["curves"] == f"tensorboard --logdir {tmp_path / 'run' / 'tensorboard'}"
    assert said["export"].startswith(f"python -m tools.hf_convert export {tmp_path / 'run'} ")
    # The continue command, as printed, resumes at step 2 and trains on.
    command = shlex.split(said["continue"])
    assert command[:3] == ["python", "-m", "dtrain.run"]
    code, log, err = run(tmp_path / "run", command[3:], args=[])
    assert code == 0, err
    assert "resumed from" in log and "step 4/4 | loss" in log, log[-2000:]
    assert (tmp_path / "run" / ckpt.CHECKPOINTS / ckpt.checkpoint_name(4) / ckpt.COMPLETE).is_file()


def test_no_final_checkpoint_saves_nothing_and_says_so(tmp_path, run):
    code, log, err = run(tmp_path / "run", ["--no-final-checkpoint"])
    assert code == 0, err
    assert not ckpt.valid_checkpoints(tmp_path / "run" / ckpt.CHECKPOINTS)
    said = _closing(log)
    assert said["checkpoint"] == "none saved at this step" and "continue" not in said


def test_checkpoints_every_n_steps_end_on_the_last_step_unless_turned_off(tmp_path, run):
    assert run(tmp_path / "a", ["--steps", "3", "--checkpoint-every", "2"])[0] == 0
    assert [step for step, _ in ckpt.valid_checkpoints(tmp_path / "a" / ckpt.CHECKPOINTS)] == [2, 3]
    assert run(tmp_path / "b", ["--steps", "3", "--checkpoint-every", "2", "--no-final-checkpoint"])[0] == 0
    assert [step for step, _ in ckpt.valid_checkpoints(tmp_path / "b" / ckpt.CHECKPOINTS)] == [2]


def test_a_run_directory_holding_another_run_is_refused_unless_resumed_or_overwritten(tmp_path, run):
    run_dir = tmp_path / "run"
    assert run(run_dir, [])[0] == 0
    log_before = (run_dir / "train.log").read_text()
    code, _, err = run(run_dir, ["--seed", "1"])
    assert code == 2 and "\n" not in err, err
    assert f"--run-dir {run_dir} holds another run (train.log, TensorBoard event files, checkpoints)" in err
    assert "--resume" in err and "--overwrite" in err
    assert (run_dir / "train.log").read_text() == log_before  # refused before writing there
    # --overwrite with a mistake elsewhere deletes nothing: the options are checked first.
    assert run(run_dir, ["--overwrite", "--mesh", "tq=2"])[0] == 2
    assert (run_dir / "train.log").read_text() == log_before
    code, log, err = run(run_dir, ["--overwrite", "--seed", "1"])
    assert code == 0, err
    assert "--overwrite: deleted the previous run's" in log
    assert "seed = 1" in (run_dir / "config.toml").read_text()
    assert (run_dir / "train.log").read_text().count("step 2/2 | loss") == 1  # the old log is gone
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [step for step, _ in ckpt.valid_checkpoints(run_dir / ckpt.CHECKPOINTS)] == [2]


def test_overwrite_with_resume_is_refused(tmp_path, run):
    code, _, err = run(tmp_path / "run", ["--overwrite", "--resume", "auto"])
    assert code == 2 and "--overwrite deletes the run that --resume auto would continue" in err, err
