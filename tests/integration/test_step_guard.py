"""Skipping bad steps: a non-finite loss or gradient norm, or a loss spike, leaves the weights, the
AdamW state and the MoE router bias as they were, on every rank; the schedule and the data move
on; too many skips in a row stop the run; a resumed run skips what the uninterrupted one skipped."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dtrain import distributed
from dtrain.checkpoint import storage as ckpt
from dtrain.resilience.faults import SPIKE_FACTOR
from dtrain.trainer import Trainer
from tests.launch import TINY_ARGS, run_cli, scalars, train_scalars
from tests.layouts import resolved
from tests.unit.test_step_guard import _snapshot


LOSS_RTOL = 1e-4  # another mesh: float reductions in another order


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_both_as_one_process_skips_it(tmp_path):
    args = ["--steps", "4"]
    single = train_scalars(tmp_path / "single", args, env={"DTRAIN_FAULT": "nan@step3"})
    pair = train_scalars(tmp_path / "dp2", [*args, "--mesh", "dp=2"], nproc=2, env={"DTRAIN_FAULT": "nan@rank1:step3"})
    for run in (single, pair):
        assert run["train/skipped"] == [0, 0, 1, 0] and math.isnan(run["train/loss"][2])
    for step in (0, 1, 3):
        assert pair["train/loss"][step] == pytest.approx(single["train/loss"][step], rel=LOSS_RTOL)


def _all_finite(checkpoint, tmp_path) -> bool:
    dcp_to_torch_save(checkpoint, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    tensors = [v for part in ("model", "optim") for v in state[part].values() if isinstance(v, torch.Tensor)]
    return len(tensors) > 10 and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


@pytest.mark.slow
def test_a_nan_gradient_norm_with_a_finite_loss_is_skipped_and_never_saved(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*TINY_ARGS, "--steps", "12", "--lr", "1e3", "--warmup-steps", "0", "--checkpoint-every", "2",
                      "--max-skipped-steps", "2", "--run-dir", str(run_dir)])
    err = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and err.startswith("dtrain: error: steps "), result.stderr[-3000:]
    assert "were all skipped" in err and "gradient norm nan" in err, err
    logged = scalars(run_dir)
    finite_loss_nan_norm = [s for s, (loss, norm) in enumerate(zip(logged["train/loss"], logged["train/grad_norm"]))
                            if math.isfinite(loss) and math.isnan(norm)]
    assert finite_loss_nan_norm and all(logged["train/skipped"][s] == 1 for s in finite_loss_nan_norm)
    saved = ckpt.valid_checkpoints(run_dir / ckpt.CHECKPOINTS)
    assert saved and saved[-1][0] >= finite_loss_nan_norm[0] + 1  # one saved after a skip
    for _, path in saved:
        assert _all_finite(path, tmp_path), path


@pytest.mark.slow
def test_a_resumed_run_skips_the_spikes_the_uninterrupted_one_skipped_bit_for_bit(tmp_path):
    """Spikes at steps 3 (before the checkpoint at 5) and 6 (after): the one at 6 is a spike only
    against the median of steps 4 and 5, which the resumed run has from the checkpoint alone."""
    args = ["--skip-spikes", "3", "--spike-window", "2", "--checkpoint-every", "5"]
    faults = {"DTRAIN_FAULT": "spike@step3,spike@step6"}
    whole = train_scalars(tmp_path / "whole", args, env=faults)
    assert whole["train/skipped"] == [0, 0, 1, 0, 0, 1, 0, 0, 0, 0]
    assert whole["train/loss"][2] > 0.5 * SPIKE_FACTOR * whole["train/loss"][1]
    resumed = train_scalars(tmp_path / "resumed", [*args, "--resume", str(tmp_path / "whole" / "checkpoints" /
                                                                        "step_000005")], env=faults)
    assert resumed["train/skipped"] == whole["train/skipped"][5:]
    assert resumed["train/skipped_steps"] == whole["train/skipped_steps"][5:] == [2] * 5
    assert resumed["train/loss"] == whole["train/loss"][5:]


@pytest.mark.gpu
def test_a_nan_on_one_gpu_is_skipped_by_both_under_fsdp_float8_all_gather_and_compile(tmp_path):
    """The CUDA path: the fused AdamW's found_inf over FSDP2 DTensors, float8 all-gather scales
    recomputed from the unchanged weights, compiled blocks; and a checkpoint after the skip."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    args = ["--precision", "bf16", "--seq-len", "256", "--micro-batch", "4", "--steps", "6", "--mesh", "dp=2",
            "--fp8", "tensorwise", "--compile", "--checkpoint-every", "3"]
    clean = train_scalars(tmp_path / "clean", args, nproc=2)
    faulty = train_scalars(tmp_path / "faulty", args, nproc=2, env={"DTRAIN_FAULT": "nan@rank1:step3"})
    assert clean["train/skipped"] == [0] * 6 and faulty["train/skipped"] == [0, 0, 1, 0, 0, 0]
    assert faulty["train/loss"][:2] == pytest.approx(clean["train/loss"][:2], rel=1e-3)
    assert all(math.isfinite(x) for x in faulty["train/loss"][3:] + faulty["train/grad_norm"][3:])
    assert ckpt.valid_checkpoints(tmp_path / "faulty" / ckpt.CHECKPOINTS)[-1][0] == 6


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_a_nan_step_changes_no_weight_moment_or_router_bias_but_moves_the_schedule_and_data(
        tmp_path, monkeypatch, model):
    monkeypatch.setenv("DTRAIN_FAULT", "nan@step3")
    overrides = ["--model-overrides", "bias_update_rate=0.01"] if model == "tiny-moe" else []
    layout = resolved([*TINY_ARGS, "--model", model, *overrides, "--steps", "4", "--run-dir", str(tmp_path)])
    runtime = distributed.init_process_group()
    try:
        trainer = Trainer(layout, runtime)
        for _ in range(2):
            assert trainer._read_back(trainer.launch_step())["train/skipped"] == 0
        before = _snapshot(trainer)
        lr_before = trainer.scheduler.get_last_lr()[0]
        scalars = trainer._read_back(trainer.launch_step())
        assert scalars["train/skipped"] == 1 and scalars["train/skipped_steps"] == 1
        assert math.isnan(scalars["train/loss"]) and scalars["train/lr"] == lr_before
        after = _snapshot(trainer)
        assert after.keys() == before.keys()
        if model == "tiny-moe":
            assert any(name.endswith("router_bias") for name in after)
        for name in before:
            assert torch.equal(after[name], before[name]), name
        assert trainer.scheduler.get_last_lr()[0] != lr_before and trainer.consumed_samples == 3 * 8
        scalars = trainer._read_back(trainer.launch_step())
        assert scalars["train/skipped"] == 0 and math.isfinite(scalars["train/loss"])
        assert all(not torch.equal(after[n], p) for n, p in trainer.model.named_parameters() if "router_bias" not in n)
    finally:
        distributed.shutdown()
