"""A checkpoint pruned while it is read: a run that writes with --keep-last 1 deletes its older
checkpoint right after it commits a newer one, so a reader of that run directory (an export, a
resume elsewhere) may find the one it chose gone midway. The reader takes the newest again;
the pruned one is never called corrupt, and a named one that vanished is one clear line."""

from __future__ import annotations

import shutil

import pytest

from dtrain.checkpoint import storage as ckpt
from dtrain.run import main
from tests.launch import TINY_ARGS
from tools import hf_convert


@pytest.fixture
def live_run(reference, tmp_path, monkeypatch):
    """A run directory holding step 3, whose writer commits step 6 and prunes step 3 (keep-last 1)
    the first time a reader has chosen step 3 and begins to check it."""
    root = tmp_path / "writer" / ckpt.CHECKPOINTS
    shutil.copytree(reference[0] / ckpt.CHECKPOINTS / "step_000003", root / "step_000003")
    check = ckpt.check_checkpoint

    def check_while_the_writer_goes_on(path, *args, **kwargs):
        if path.name == "step_000003" and not (root / "step_000006").exists():
            shutil.copytree(reference[0] / ckpt.CHECKPOINTS / "step_000006", root / "step_000006")
            ckpt.prune(root, keep_last=1)
        return check(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "check_checkpoint", check_while_the_writer_goes_on)
    return root


def test_an_export_takes_the_newest_again_when_its_checkpoint_is_pruned(live_run, tmp_path, capsys):
    code = hf_convert.main(["export", str(live_run.parent), str(tmp_path / "hf")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert hf_convert._read_newest(live_run.parent)[3]["step"] == 6


def test_an_export_of_a_named_checkpoint_that_is_pruned_is_one_line(live_run, tmp_path, capsys):
    code = hf_convert.main(["export", str(live_run / "step_000003"), str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert f"checkpoint {live_run / 'step_000003'} was deleted while it was read" in err, err


def test_a_resume_from_a_live_run_takes_the_newest_again_and_calls_nothing_corrupt(live_run, tmp_path, caplog):
    code = main([*TINY_ARGS, "--steps", "7", "--run-dir", str(tmp_path / "reader"), "--resume", str(live_run.parent)])
    assert code == 0, caplog.text[-3000:]
    assert f"resumed from {live_run / 'step_000006'} at step 6" in caplog.text, caplog.text[-3000:]
    assert "corrupt" not in caplog.text, caplog.text[-3000:]
    assert sorted(p.name for p in live_run.iterdir()) == ["step_000006"]


@pytest.mark.slow
def test_exports_beside_a_live_writer_that_keeps_one_checkpoint_all_succeed(tmp_path, capsys):
    import subprocess
    import sys

    from tests.launch import REPO, cli_env

    run_dir = tmp_path / "writer"
    writer = subprocess.Popen([sys.executable, "-m", "dtrain.run", *TINY_ARGS, "--steps", "15", "--run-dir",
                               str(run_dir), "--checkpoint-every", "1", "--keep-last", "1"], cwd=REPO, env=cli_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    codes = []
    try:
        while writer.poll() is None:
            if ckpt.valid_checkpoints(run_dir / ckpt.CHECKPOINTS):
                codes.append(hf_convert.main(["export", str(run_dir), str(tmp_path / f"hf{len(codes)}")]))
    finally:
        writer.wait(timeout=300)
    errors = capsys.readouterr().err
    assert writer.returncode == 0, writer.stderr.read()[-3000:]
    assert len(codes) >= 2 and set(codes) == {0}, (codes, errors[-3000:])
