"""A disk that fills up during a save: one line that says so, the previous checkpoint stays the
latest, nothing of the failed save is left to block a restart, and the restart goes on once the
space is back. On a real full device (a small tmpfs in a private mount namespace, where this
process may mount one), and, everywhere, through a writer that fails with ENOSPC at a chosen
tensor."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dtrain.checkpoint import storage as ckpt
from tests.launch import REPO, TINY_ARGS, cli_env, run_cli


ARGS = [*TINY_ARGS, "--steps", "4", "--checkpoint-every", "2"]


MODES = pytest.mark.parametrize("extra", [[], ["--async-checkpoint"]], ids=["sync", "async"])


def _check_failed_save(run_dir, err: str) -> None:
    checkpoints = run_dir / ckpt.CHECKPOINTS
    assert err.count("\n") == 0 and err.startswith("dtrain: error: "), err
    assert (f"the checkpoint of step 4 could not be written: no space is left on the device of {checkpoints}"
            in err and "step_000002 stays the latest" in err), err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"]  # the failed save is gone
    assert (run_dir / "failures" / "rank_00000.jsonl").is_file()  # its space let the record be written


@MODES
def test_a_save_that_finds_the_disk_full_is_one_line_and_the_restart_goes_on(tmp_path, extra):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "disk_full").touch()
    env = {"DTRAIN_TEST_FULL_AT": "4"}
    result = run_cli([*ARGS, *extra, "--run-dir", str(run_dir)], module="tests.workers.disk_full", env=env)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    _check_failed_save(run_dir, result.stderr.strip())
    (run_dir / "disk_full").unlink()  # the space is back
    result = run_cli([*ARGS, *extra, "--run-dir", str(run_dir), "--resume"], module="tests.workers.disk_full",
                     env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "step_000002 at step 2" in result.stdout and "step 4/4" in result.stdout, result.stdout[-2000:]
    assert not list(run_dir.rglob(".write_test.*"))


_ON_A_SMALL_TMPFS = """
mount -t tmpfs -o size=10m tmpfs "$MNT" || exit 99
"$PY" -m dtrain.run $ARGS --run-dir "$MNT/run"
echo "first=$?"
ls "$MNT/run/checkpoints" | sed 's/^/left /'
mount -o remount,size=40m "$MNT"
"$PY" -m dtrain.run $ARGS --run-dir "$MNT/run" --resume
echo "second=$?"
"""


@pytest.mark.slow
@MODES
def test_a_real_full_device_during_a_save(tmp_path, extra):
    """10 MB hold the first checkpoint (6 MB) and part of the second; the device is then grown."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and unshare")
    mount = tmp_path / "mnt"
    mount.mkdir()
    env = cli_env({"MNT": str(mount), "PY": sys.executable, "ARGS": " ".join([*ARGS, *extra])})
    result = subprocess.run([unshare, "-m", "sh", "-c", _ON_A_SMALL_TMPFS], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    if result.returncode == 99:
        pytest.skip("no tmpfs can be mounted here")
    out, err = result.stdout, result.stderr
    assert "first=2" in out and "second=0" in out, out[-3000:] + err[-3000:]
    [line] = [line for line in err.splitlines() if line.startswith("dtrain: error: ")]
    assert "could not be written: no space is left on the device of" in line, line
    assert [line for line in out.splitlines() if line.startswith("left ")] == ["left step_000002"], out
    assert "step_000002 at step 2" in out and "step 4/4" in out, out[-3000:]
