"""Checkpoints through the CLI (CPU, gloo, fp32): exact resume on the same mesh, resharding to
another mesh, preemption by SIGTERM or a Ctrl-C, processes SIGKILLed in the middle of a save
(synchronous or asynchronous), and one-line errors for corrupt or incompatible checkpoints."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dtrain.checkpoint import storage as ckpt
from dtrain.run import main
from models.presets import get_model_config
from tests.damage import flip_middle_bytes, same_size_garbage
from tests.launch import REPO, TINY_ARGS, cli_command, cli_env, run_cli, scalars, train_scalars


LOSS_RTOL = 1e-4  # another mesh: float reductions in another order


def _latest(run_dir: Path) -> int:
    found = ckpt.valid_checkpoints(run_dir / ckpt.CHECKPOINTS)
    return found[-1][0] if found else 0


def _assert_continues(resumed: list[float], reference: list[float], start: int, rtol: float, what: str):
    """`resumed` holds the losses of steps start+1..10; they must match the uninterrupted run's."""
    expected = reference[start:]
    assert len(resumed) == len(expected), (what, len(resumed), len(expected))
    for step, (a, e) in enumerate(zip(resumed, expected), start + 1):
        assert abs(a - e) <= rtol * abs(e), f"{what}: loss at step {step} is {a}, uninterrupted {e}"


def test_resume_on_the_same_mesh_is_exact(reference, tmp_path):
    run_dir, losses = reference
    assert [s for s, _ in ckpt.valid_checkpoints(run_dir / ckpt.CHECKPOINTS)] == [3, 6, 9, 10]
    resumed = train_scalars(tmp_path, ["--resume", str(run_dir / "checkpoints" / "step_000006")])
    # Same mesh, fp32: the same operations in the same order, so the same bits.
    assert resumed["train/loss"] == losses[6:]


@pytest.mark.slow
def test_resume_reshards_single_to_dp_to_tp_to_dp_and_pp(reference, tmp_path):
    """single@3 -> dp=2 (async saves, keep 3) @6 -> tp=2, then tp=2@8 -> dp=2 and tp=2@7 -> pp=2,
    each against the uninterrupted run."""
    ref_dir, losses = reference
    dp = train_scalars(tmp_path / "dp", ["--mesh", "dp=2", "--resume", str(ref_dir / "checkpoints" / "step_000003"),
                                         "--checkpoint-every", "2", "--async-checkpoint", "--keep-last", "3"], nproc=2)
    _assert_continues(dp["train/loss"], losses, 3, LOSS_RTOL, "single -> dp=2")
    dp_checkpoints = tmp_path / "dp" / ckpt.CHECKPOINTS
    assert sorted(p.name for p in dp_checkpoints.iterdir()) == ["step_000006", "step_000008", "step_000010"]
    tp = train_scalars(tmp_path / "tp", ["--mesh", "tp=2", "--resume", str(dp_checkpoints / "step_000006"),
                                         "--checkpoint-every", "1"], nproc=2)
    _assert_continues(tp["train/loss"], losses, 6, LOSS_RTOL, "dp=2 -> tp=2")
    back = train_scalars(tmp_path / "back", ["--mesh", "dp=2", "--resume",
                                             str(tmp_path / "tp" / "checkpoints" / "step_000008")], nproc=2)
    _assert_continues(back["train/loss"], losses, 8, LOSS_RTOL, "tp=2 -> dp=2")
    # Pipeline stages hold parts of the model; the checkpoint keys stay the global parameter names.
    pp = train_scalars(tmp_path / "pp", ["--mesh", "pp=2", "--resume",
                                         str(tmp_path / "tp" / "checkpoints" / "step_000007")], nproc=2)
    _assert_continues(pp["train/loss"], losses, 7, LOSS_RTOL, "tp=2 -> pp=2")


def _start_cli(args: list[str], nproc: int = 1) -> subprocess.Popen:
    """The CLI (under torchrun for nproc > 1) in a process group of its own, as a terminal starts a
    command: os.killpg reaches it as a Ctrl-C does."""
    return subprocess.Popen(cli_command(args, nproc), cwd=REPO, env=cli_env(), text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(proc: subprocess.Popen, text: str, log: list[str]) -> bool:
    for line in proc.stdout:
        log.append(line)
        if text in line:
            return True
    return False


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly_then_resume_continues(reference, tmp_path):
    _, losses = reference
    run_dir = tmp_path / "preempted"
    proc = _start_cli([*TINY_ARGS, "--run-dir", str(run_dir)])  # checkpoints off: the save is for the signal
    log: list[str] = []
    assert _wait_for(proc, "step  2/10", log), "".join(log)
    proc.send_signal(signal.SIGTERM)
    log.extend(proc.stdout)
    assert proc.wait(timeout=120) == 0, "".join(log)
    stopped = _latest(run_dir)
    assert 2 <= stopped < 10, "".join(log)
    assert any("received SIGTERM" in line and f"at step {stopped}/10" in line for line in log), "".join(log)
    resumed = train_scalars(tmp_path / "resumed", ["--resume", str(run_dir)])
    assert resumed["train/loss"] == losses[stopped:]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["one process", "torchrun"])
def test_a_first_ctrl_c_saves_at_the_next_step_boundary_and_exits_then_resume_continues(request, tmp_path, nproc):
    losses = request.getfixturevalue("reference")[1] if nproc == 1 else request.getfixturevalue("dp2_run")["train/loss"]
    run_dir = tmp_path / "interrupted"
    proc = _start_cli([*TINY_ARGS, "--run-dir", str(run_dir)], nproc)  # checkpoints off: the save is for the signal
    log: list[str] = []
    try:
        assert _wait_for(proc, "step  2/10", log), "".join(log)
        os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C does: the terminal's foreground process group
        log.extend(proc.stdout)
        code, output = proc.wait(timeout=120), "".join(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if nproc == 1:
        assert code == 0, output
    else:
        # torchrun's agent hands the SIGINT on to its workers (each in a session of its own, out of
        # the Ctrl-C's reach), waits for them and then exits 1 itself, naming the signal it got.
        assert code == 1 and "got signal: 2" in output and "forcefully exiting" not in output, output
    assert "dtrain: error" not in output and output.count("Traceback") == (nproc > 1), output  # torchrun's own
    stopped = _latest(run_dir)
    assert 2 <= stopped < 10, output
    saved = run_dir / ckpt.CHECKPOINTS / ckpt.checkpoint_name(stopped)
    said = [line for line in log if "received SIGINT" in line]
    assert len(said) == 1 and f"received SIGINT: saved {saved} at step {stopped}/10 and stopped" in said[0], output
    assert f"run stopped at step {stopped} of 10" in output and "stopped without saving" not in output, output
    resumed = train_scalars(tmp_path / "resumed", ["--resume", str(run_dir)], nproc=nproc)
    assert resumed["train/loss"] == losses[stopped:]


@pytest.mark.slow
def test_save_killed_midway_leaves_the_previous_checkpoint(reference, tmp_path, monkeypatch):
    _, losses = reference
    args = [*TINY_ARGS, "--run-dir", str(tmp_path), "--checkpoint-every", "2", "--resume", "auto"]
    checkpoints = tmp_path / ckpt.CHECKPOINTS
    # Killed while writing the shards of step 4: step 2 stays the latest valid checkpoint.
    monkeypatch.setenv("DTRAIN_TEST_DIE_WHERE", "shards")
    monkeypatch.setenv("DTRAIN_TEST_DIE_AT", "4")
    result = run_cli(args, module="tests.workers.die_mid_save")
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-3000:]
    assert (checkpoints / "step_000004.tmp").is_dir() and not (checkpoints / "step_000004.tmp" / ".metadata").exists()
    assert _latest(tmp_path) == 2
    # Resumed from step 2; killed after the COMPLETE marker of step 6 but before its rename.
    monkeypatch.setenv("DTRAIN_TEST_DIE_WHERE", "commit")
    monkeypatch.setenv("DTRAIN_TEST_DIE_AT", "6")
    result = run_cli(args, module="tests.workers.die_mid_save")
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-3000:]
    assert "removed incomplete checkpoints: step_000004.tmp" in result.stdout, result.stdout[-2000:]
    assert "step_000002 at step 2" in result.stdout, result.stdout[-2000:]
    assert (checkpoints / "step_000006.tmp" / ckpt.COMPLETE).exists() and _latest(tmp_path) == 4
    result = run_cli(args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # Step 6 was whole, COMPLETE written: it takes its final name and the run continues from it.
    assert "interrupted after they were complete: step_000006" in result.stdout, result.stdout[-2000:]
    assert "step_000006 at step 6" in result.stdout, result.stdout[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_{s:06d}" for s in (2, 4, 6, 8, 10)]
    assert f"step 10/10 | loss {losses[-1]:.4f}" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint(reference, tmp_path):
    _, losses = reference
    args = [*TINY_ARGS, "--run-dir", str(tmp_path), "--checkpoint-every", "2", "--async-checkpoint",
            "--resume", "auto"]
    checkpoints = tmp_path / ckpt.CHECKPOINTS
    # Killed at the boundary of step 5, while the background save of step 4 is halfway through its shards.
    result = run_cli(args, module="tests.workers.die_mid_save",
                     env={"DTRAIN_TEST_DIE_WHERE": "async", "DTRAIN_TEST_DIE_AT": "4"})
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-3000:]
    assert "step  5/10" in result.stdout, result.stdout[-2000:]  # the run went on while the save was written
    half = checkpoints / "step_000004.tmp"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", half.name]
    assert list(half.glob("*.distcp")) and not (half / ".metadata").exists() and not (half / ckpt.COMPLETE).exists()
    assert _latest(tmp_path) == 2
    result = run_cli(args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "removed incomplete checkpoints: step_000004.tmp" in result.stdout, result.stdout[-2000:]
    assert "step_000002 at step 2" in result.stdout, result.stdout[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_{s:06d}" for s in (2, 4, 6, 8, 10)]
    # Steps 1-2 from the killed run, 3-10 from the resumed one (TensorBoard dropped what came after 2).
    assert scalars(tmp_path)["train/loss"] == losses


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_broken_checkpoint(tmp_path):
    args = [*TINY_ARGS, "--run-dir", str(tmp_path), "--checkpoint-every", "1", "--resume", "auto"]
    model_cfg = get_model_config("tiny")
    shapes = _tiny_param_shapes()
    rng = random.Random()
    delays = []
    for _ in range(3):
        proc = _start_cli(args)
        log: list[str] = []
        assert _wait_for(proc, "saved checkpoint", log) or proc.wait() == 0, "".join(log)
        delays.append(rng.uniform(0.0, 0.6))
        time.sleep(delays[-1])
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        # Whatever the moment, every checkpoint under its final name loads cleanly.
        for _, path in ckpt.valid_checkpoints(tmp_path / ckpt.CHECKPOINTS):
            ckpt.check_checkpoint(path, model_cfg, shapes)
        final_names = [p for p in (tmp_path / ckpt.CHECKPOINTS).iterdir() if ckpt._NAME.match(p.name)]
        assert all((p / ckpt.COMPLETE).exists() for p in final_names), (delays, final_names)
    result = run_cli(args)
    assert result.returncode == 0, (delays, result.stdout[-2000:] + result.stderr[-3000:])
    assert _latest(tmp_path) == 10


def _tiny_param_shapes() -> dict[str, tuple[int, ...]]:
    from dtrain.interop.hf import param_shapes

    return param_shapes(get_model_config("tiny"))


def _corrupt_copy(reference_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "step_000003"
    shutil.copytree(reference_dir / "checkpoints" / "step_000003", target)
    return target


def _edit_meta_json(path: Path) -> None:
    text = (path / "meta.json").read_text()
    (path / "meta.json").write_text(text.replace('"step": 3', '"step": 4'))


CORRUPTIONS = [
    ("delete a shard file", lambda p: (p / "__0_0.distcp").unlink(), [], "file __0_0.distcp is missing"),
    ("truncate a shard file", lambda p: os.truncate(p / "__0_0.distcp", 1000), [], "__0_0.distcp has 1000 bytes"),
    ("flip bytes inside a shard", lambda p: flip_middle_bytes(p / "__0_0.distcp"), [],
     "file __0_0.distcp does not match its checksum"),
    ("delete .metadata", lambda p: (p / ".metadata").unlink(), [], "file .metadata is missing"),
    ("random bytes in .metadata", lambda p: same_size_garbage(p / ".metadata"), [],
     "file .metadata does not match its checksum"),
    ("truncate .metadata", lambda p: os.truncate(p / ".metadata", 100), [], ".metadata has 100 bytes"),
    ("delete meta.json", lambda p: (p / "meta.json").unlink(), [], "no readable meta.json"),
    ("edit meta.json", _edit_meta_json, [], "meta.json does not match the checksum in COMPLETE"),
    ("delete COMPLETE", lambda p: (p / "COMPLETE").unlink(), [], "is incomplete"),
    ("another model shape", lambda p: None, ["--model-overrides", "num_layers=2"],
     "saved for a model with num_layers=4 but this run's model has num_layers=2"),
    ("another vocabulary", lambda p: None, ["--data", "synthetic", "--model-overrides", "vocab_size=1000"],
     "vocab_size=2048"),
]


@pytest.mark.parametrize("corrupt,extra,message", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_or_incompatible_checkpoint_is_one_clear_line(reference, tmp_path, capsys, corrupt, extra, message):
    path = _corrupt_copy(reference[0], tmp_path)
    corrupt(path)
    code = main([*TINY_ARGS, "--run-dir", str(tmp_path / "run"), "--resume", str(path), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("dtrain: error: ") and "\n" not in err, err
    assert message in err, err


def test_a_mismatched_parameter_shape_in_the_shards_is_caught(reference, tmp_path):
    # meta.json agrees with the run but a tensor does not: the per-tensor check catches it.
    path = _corrupt_copy(reference[0], tmp_path)
    shapes = dict(_tiny_param_shapes(), **{"blocks.0.attn.wq": (32, 64)})
    with pytest.raises(ckpt.UserError, match=r"blocks.0.attn.wq has shape \[64, 64\] but the model needs \[32, 64\]"):
        ckpt.check_checkpoint(path, get_model_config("tiny"), shapes)


def test_a_kill_between_the_commits_two_renames_recovers_the_new_checkpoint(reference, tmp_path):
    """A resumed run saving a step again renames the old step_N aside (.old), then its complete
    step_N.tmp into place; killed between the two, both are whole and neither has the final name."""
    root = tmp_path / ckpt.CHECKPOINTS
    source = reference[0] / ckpt.CHECKPOINTS
    shutil.copytree(source / "step_000003", root / "step_000006.old")  # the step 6 it replaces
    shutil.copytree(source / "step_000006", root / "step_000006.tmp")  # committed, not yet renamed
    shutil.copytree(source / "step_000003", root / "step_000003")
    (root / "step_000009.tmp").mkdir()  # a save killed while writing: nothing to recover
    assert ckpt.recover_commits(root) == ["step_000006"]
    assert ckpt.remove_incomplete(root) == ["step_000006.old", "step_000009.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000006"]
    meta, _ = ckpt.check_checkpoint(root / "step_000006", get_model_config("tiny"), _tiny_param_shapes())
    assert meta["step"] == 6
    # A complete .tmp never replaces a committed checkpoint of its step, and a lone .old (a prune
    # killed while deleting it) is never brought back.
    shutil.copytree(source / "step_000009", root / "step_000006.tmp")
    shutil.copytree(source / "step_000009", root / "step_000009.old")
    assert ckpt.recover_commits(root) == []
    assert ckpt.remove_incomplete(root) == ["step_000006.tmp", "step_000009.old"]
    assert ckpt.read_meta(root / "step_000006")["step"] == 6


def test_a_restart_after_a_kill_between_the_two_renames_resumes_from_that_step(reference, tmp_path, caplog):
    """The same leftovers met by the run's start: it resumes from the recovered step, not from an
    earlier one."""
    run_dir = tmp_path / "run"
    root, source = run_dir / ckpt.CHECKPOINTS, reference[0] / ckpt.CHECKPOINTS
    shutil.copytree(source / "step_000003", root / "step_000003")
    shutil.copytree(source / "step_000003", root / "step_000006.old")
    shutil.copytree(source / "step_000006", root / "step_000006.tmp")
    assert main([*TINY_ARGS, "--steps", "7", "--run-dir", str(run_dir), "--resume"]) == 0
    assert f"resumed from {root / 'step_000006'} at step 6" in caplog.text, caplog.text
    # The leftovers are gone; the resumed run saved its last step.
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000006", "step_000007"]
