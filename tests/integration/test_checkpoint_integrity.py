"""Checkpoints that cannot lie: checksums of every file verified in parallel at resume, a fall back
from a corrupt latest checkpoint to the newest good one, no save of non-finite weights, and a
resume with another global batch or learning rate that says what it changes and applies it, and
a read-only checkpoint directory found before the first step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dtrain.checkpoint import storage as ckpt
from dtrain.config import OptimArgs
from dtrain.optim import lr_multiplier
from dtrain.run import main
from tests.damage import flip_middle_bytes, same_size_garbage
from tests.launch import REPO, TINY_ARGS, run_cli, scalars


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_good_one(reference, tmp_path):
    ref_dir, losses = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir / ckpt.CHECKPOINTS, run_dir / ckpt.CHECKPOINTS)
    checkpoints = run_dir / ckpt.CHECKPOINTS
    flip_middle_bytes(checkpoints / "step_000010" / "__0_0.distcp")
    same_size_garbage(checkpoints / "step_000009" / ".metadata")
    result = run_cli([*TINY_ARGS, "--run-dir", str(run_dir), "--resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert (f"checkpoint {checkpoints / 'step_000010'} is corrupt: file __0_0.distcp does not match its checksum; "
            f"resuming from the one before it, {checkpoints / 'step_000009'}") in out, out[-3000:]
    assert "file .metadata does not match its checksum; resuming from the one before it" in out, out[-3000:]
    assert f"resumed from {checkpoints / 'step_000006'} at step 6" in out, out[-3000:]
    # Set aside for inspection, so that the next restart does not try them again; the resumed run
    # ends with its own final checkpoint.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000003", "step_000006", "step_000009.corrupt",
                                                             "step_000010", "step_000010.corrupt"]
    assert scalars(run_dir)["train/loss"] == losses[6:]


def test_every_checkpoint_corrupt_is_one_line(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0] / ckpt.CHECKPOINTS / "step_000003", run_dir / ckpt.CHECKPOINTS / "step_000003")
    flip_middle_bytes(run_dir / ckpt.CHECKPOINTS / "step_000003" / "__0_0.distcp")
    code = main([*TINY_ARGS, "--run-dir", str(run_dir), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert "--resume latest: no valid checkpoint in" in err and "every one is corrupt (step_000003.corrupt)" in err, err


@pytest.mark.slow
def test_resume_with_another_global_batch_and_lr_says_so_and_applies_both(reference, tmp_path):
    run_dir = tmp_path / "run"
    resumed_from = reference[0] / ckpt.CHECKPOINTS / "step_000003"
    result = run_cli([*TINY_ARGS, "--steps", "5", "--global-batch", "16", "--lr", "2e-3", "--checkpoint-every", "5",
                      "--run-dir", str(run_dir), "--resume", str(resumed_from)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "settings that differ from the checkpoint's run apply from step 4 on: " in out, out[-3000:]
    assert "data.global_batch 8 -> 16" in out and "optim.lr 0.001 -> 0.002" in out and "train.steps 10 -> 5" in out
    assert "the data continues at sample 24 of the stream" in out, out[-3000:]
    lrs = scalars(run_dir)["train/lr"]
    args = OptimArgs(lr=2e-3)
    assert lrs == pytest.approx([2e-3 * lr_multiplier(step, 5, args) for step in (3, 4)], rel=1e-6)
    meta = json.loads((run_dir / ckpt.CHECKPOINTS / "step_000005" / ckpt.META).read_text())
    assert meta["consumed_samples"] == 3 * 8 + 2 * 16 and meta["global_batch"] == 16


def _read_only_command(directory, command: list[str]) -> list[str] | None:
    """`command` run where `directory` cannot be written: by permissions, or (as root, whom
    permissions do not stop) on a read-only bind mount in a private mount namespace."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return command
    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run([unshare, "-m", "sh", "-c", f"mount --bind -o ro {directory} {directory}"],
                                       capture_output=True)
    if not probe or probe.returncode != 0:
        return None
    inner = " ".join(f"'{part}'" for part in command)
    return [unshare, "-m", "sh", "-c", f"mount --bind -o ro '{directory}' '{directory}' && exec {inner}"]


def test_a_read_only_checkpoint_directory_is_refused_before_the_first_step(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    command = _read_only_command(run_dir / "checkpoints", [
        sys.executable, "-m", "dtrain.run", *TINY_ARGS, "--run-dir", str(run_dir), "--checkpoint-every", "5"])
    if command is None:
        pytest.skip("no way to make a read-only directory here (root without mount namespaces)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    err = result.stderr.strip()
    assert result.returncode == 2 and "\n" not in err, result.stdout[-2000:] + err
    assert f"checkpoint directory {run_dir / 'checkpoints'} is not writable" in err, err
    assert "step 1/" not in result.stdout
