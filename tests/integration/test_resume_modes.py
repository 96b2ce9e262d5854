"""What `--resume` does where a run directory holds no checkpoint to load: `--resume` (latest)
must find one; `--resume auto` (for job scripts that restart) starts at step 0 only where the run
never had a checkpoint, and stops where its checkpoints are all corrupt; `--start-over` is the
user's word that step 0 is fine then. Progress is never dropped without an error."""

from __future__ import annotations

import shutil

import pytest

from dtrain.checkpoint import storage as ckpt
from dtrain.run import main
from tests.damage import flip_middle_bytes
from tests.launch import TINY_ARGS, run_cli


ARGS = [*TINY_ARGS, "--steps", "2"]


@pytest.fixture
def run(capsys, caplog):
    """`run(run_dir, flags)`: the CLI in this process; (exit code, its log, its stderr)."""
    def run(run_dir, extra) -> tuple[int, str, str]:
        caplog.clear()
        code = main([*ARGS, "--run-dir", str(run_dir), *extra])
        return code, caplog.text, capsys.readouterr().err.strip()

    return run


def _corrupt_run(reference, tmp_path):
    """A run directory whose two checkpoints are both damaged."""
    run_dir = tmp_path / "run"
    for step in (3, 6):
        name = ckpt.checkpoint_name(step)
        shutil.copytree(reference[0] / ckpt.CHECKPOINTS / name, run_dir / ckpt.CHECKPOINTS / name)
        flip_middle_bytes(run_dir / ckpt.CHECKPOINTS / name / "__0_0.distcp")
    return run_dir


def test_resume_of_a_run_directory_without_a_checkpoint_is_an_error(tmp_path, run):
    code, _, err = run(tmp_path / "run", ["--resume"])
    assert code == 2 and "\n" not in err, err
    assert f"--resume latest: no checkpoint in {tmp_path / 'run' / ckpt.CHECKPOINTS}" in err, err
    assert "--resume auto" in err and "--start-over" in err, err
    assert not (tmp_path / "run" / "events").exists()


def test_resume_auto_starts_a_run_that_never_saved_at_step_zero(tmp_path, run):
    code, out, err = run(tmp_path / "run", ["--resume", "auto", "--checkpoint-every", "2"])
    assert code == 0, err
    assert "no checkpoint in" in out and "yet; starting from step 0" in out, out
    code, out, err = run(tmp_path / "run", ["--resume", "auto"])  # then it resumes
    assert code == 0 and "at step 2" in out, out + err


@pytest.mark.parametrize("resume,shown", [(["--resume"], "latest"), (["--resume", "auto"], "auto")],
                         ids=["latest", "auto"])
def test_a_restart_that_finds_only_corrupt_checkpoints_stops_every_time_unless_told_to_start_over(
        reference, tmp_path, run, resume, shown):
    run_dir = _corrupt_run(reference, tmp_path)
    checkpoints = run_dir / ckpt.CHECKPOINTS
    for attempt in range(2):  # the first attempt sets them aside; the second must not start at 0
        code, out, err = run(run_dir, resume)
        assert "step 1/" not in out, (attempt, out)
        assert code == 2 and "\n" not in err, (attempt, err)
        assert f"--resume {shown}: no valid checkpoint in {checkpoints}: every one is corrupt" in err, (attempt, err)
        assert "step_000003.corrupt, step_000006.corrupt" in err and "--start-over" in err, err
    code, out, err = run(run_dir, ["--resume", "auto", "--start-over"])
    assert code == 0, err
    assert "--start-over: no valid checkpoint" in out and "starting from step 0" in out and "step 2/2" in out, out
    # The corrupt ones stay for inspection, beside the new run's final checkpoint.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000003.corrupt",
                                                             "step_000006.corrupt"]


def test_start_over_never_discards_a_valid_checkpoint(reference, tmp_path, run):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0] / ckpt.CHECKPOINTS / "step_000003", run_dir / ckpt.CHECKPOINTS / "step_000003")
    code, out, err = run(run_dir, ["--resume", "auto", "--start-over", "--steps", "4"])
    assert code == 0 and "at step 3" in out and "step 4/4" in out, out + err


@pytest.mark.parametrize("extra,message", [
    (["--start-over"], "--start-over needs --resume"),
    (["--resume", "elsewhere", "--start-over"], "--start-over applies to --resume latest or auto"),
])
def test_start_over_outside_a_resume_of_the_run_directory_is_refused(tmp_path, run, extra, message):
    (tmp_path / "elsewhere").mkdir()
    extra = [str(tmp_path / "elsewhere") if a == "elsewhere" else a for a in extra]
    code, _, err = run(tmp_path / "run", extra)
    assert code == 2 and message in err, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_restarts_after_every_checkpoint_proved_corrupt_never_train_from_step_zero(reference, tmp_path):
    run_dir = _corrupt_run(reference, tmp_path)
    result = run_cli([*ARGS, "--run-dir", str(run_dir), "--resume", "auto"], torchrun_args=("--max-restarts", "1"))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert output.count("every one is corrupt") == 2, output[-5000:]  # one per attempt
    assert "step 1/" not in output and "starting from step 0" not in output, output[-5000:]


def test_steps_below_the_checkpoints_step_is_refused_and_equal_is_a_finished_run(reference, tmp_path, run):
    checkpoint = reference[0] / ckpt.CHECKPOINTS / "step_000006"
    code, out, err = run(tmp_path / "run", ["--resume", str(checkpoint), "--steps", "4"])
    assert code == 2 and "\n" not in err, err
    assert f"--steps 4 is below step 6 of checkpoint {checkpoint}" in err and "--steps 7 or more" in err, err
    code, out, err = run(tmp_path / "run", ["--resume", str(checkpoint), "--steps", "6"])
    assert code == 0 and "no step is left to train" in out, out + err
