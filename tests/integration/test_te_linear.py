"""`--fp8-backend te` without Transformer Engine: the one-line errors, and the wiring through
tests/fake_te.py (which casts to torch's float8 dtypes as TE does): local shards and output
placements under tensor parallelism, the usages and scales TE receives, delayed scaling's slots,
selective recompute, checkpoints, compile, and meshes against one process. The same paths on
TE and GPUs: tests/integration/test_te_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import fake_te
from tests.unit.test_te_linear import _fp8_state
from tests.launch import TINY_ARGS, run_cli, scalars
from tests.unit.test_te_linear import TE, SMALL_BATCH, _train, _losses


def test_delayed_scaling_state_is_checkpointed_and_resumed_bit_exactly(tmp_path, monkeypatch):
    with fake_te.installed():
        reference = _losses(_train(tmp_path / "a", ["--checkpoint-every", "1"], steps=2))
        saved = _fp8_state(tmp_path / "a" / "checkpoints" / "step_000001")
        assert {"grad_scale", "blocks.0.amax_history", "blocks.3.scale"} <= set(saved)
        assert saved["blocks.0.scale"].shape == (3 * 7,) and saved["blocks.0.amax_history"].shape == (1024, 21)
        resume = ["--resume", str(tmp_path / "a" / "checkpoints" / "step_000001")]
        resumed = _losses(_train(tmp_path / "b", [*resume, "--checkpoint-every", "1"], steps=2))
        assert resumed == reference[1:]
        final_a, final_b = (_fp8_state(tmp_path / run / "checkpoints" / "step_000002") for run in "ab")
        assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
        # Without its FP8 state the same resume computes other losses: the state is what kept them.
        from dtrain.checkpoint import train_state

        monkeypatch.setattr(train_state, "load_fp8_state", lambda path, names: {})
        fresh = _losses(_train(tmp_path / "c", resume, steps=2))
        assert fresh[0] != reference[1]


def _worker(run_dir: Path, args: list[str], nproc: int = 1, env: dict[str, str] | None = None) -> dict:
    result = run_cli([*TINY_ARGS, "--run-dir", str(run_dir), *TE, *SMALL_BATCH, *args], nproc=nproc,
                     module="tests.workers.with_fake_te", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return scalars(run_dir)


@pytest.mark.slow
def test_compiled_blocks_with_selective_recompute_keep_one_graph_and_the_eager_losses(tmp_path):
    """torch.compile (AOTAutograd's partitioner and selective recompute; the aot_eager backend,
    as inductor's C++ compile is too slow for CI; tests/integration/test_te_gpu.py compiles with inductor)."""
    with fake_te.installed():
        eager = _losses(_train(tmp_path / "eager", ["--recompute", "selective"], steps=2))
    env = {"STRICT_RECOMPILES": "1", "COMPILE_BACKEND": "aot_eager", "FAKE_TE_LOG": str(tmp_path / "calls")}
    compiled = _worker(tmp_path / "compiled", ["--steps", "2", "--fp8", "delayed", "--compile", "--recompute",
                                               "selective"], env=env)["train/loss"]
    assert len(compiled) == 2
    for step, (a, e) in enumerate(zip(compiled, eager), 1):
        assert abs(a - e) <= 1e-5 * e, f"step {step}: compiled {a} vs eager {e}"
    calls = [json.loads(line) for line in (tmp_path / "calls.0").read_text().splitlines()]
    assert sum(1 for c in calls if c["op"] == "gemm" and c["layout"] == "TN") == 4 * 7 * 2 * 2


@pytest.mark.slow
def test_delayed_scaling_on_dp_and_tp_with_sp_keeps_the_scales_of_one_process(tmp_path):
    """dp=2,tp=2 with sequence parallelism against one process: the same losses (up to bf16
    rounding), and after the first step's amax reduction the saved scales of one device that saw
    the whole batch with the same weights (without it, each rank's would follow its own rows and
    weight shards)."""
    with fake_te.installed():
        single = _losses(_train(tmp_path / "single", ["--checkpoint-every", "1"], steps=2))
    mesh = _worker(tmp_path / "mesh", ["--steps", "2", "--fp8", "delayed", "--mesh", "dp=2,tp=2",
                                       "--sequence-parallel", "--checkpoint-every", "1"], nproc=4)["train/loss"]
    for step, (a, e) in enumerate(zip(mesh, single), 1):
        assert abs(a - e) <= 2e-3 * e, f"step {step}: dp=2,tp=2 {a} vs one process {e}"
    one, four = (_fp8_state(tmp_path / run / "checkpoints" / "step_000001") for run in ("single", "mesh"))
    # The loss scale doubles with dp=2: so do the gradients and their amaxes.
    assert four["grad_scale"].item() == 2 * one["grad_scale"].item()
    for name in (k for k in one if k.endswith(".scale")):
        ratio = (four[name] / one[name]).view(-1, 3)
        torch.testing.assert_close(ratio[:, 1], torch.ones_like(ratio[:, 1]), rtol=2e-3, atol=0)  # weights
        # Inputs: bf16 rounding through the blocks moves an activation's max by a few ulps (2.3% seen).
        torch.testing.assert_close(ratio[:, 0], torch.ones_like(ratio[:, 0]), rtol=4e-2, atol=0)  # inputs
        torch.testing.assert_close(ratio[:, 2], torch.full_like(ratio[:, 2], 0.5), rtol=0.15, atol=0)
