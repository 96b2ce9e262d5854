"""`--fp8-experts` (the routed experts' grouped GEMMs in Transformer Engine's FP8) through
tests/fake_te.py: the op against the same casts and matmuls written out per expert, each expert's
rows padded for the FP8 GEMMs, delayed scaling's slots of each global expert, and training runs
against the bf16 experts and across expert parallelism. On TE and a GPU: tests/integration/test_te_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch

from models.presets import get_model_config
from tests import fake_te
from tests.launch import run_cli, scalars
from tests.unit.test_te_linear import _fp8_state
from tests.unit.test_te_experts import MOE, _train


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["alltoall", "allgather"])
def test_fp8_experts_under_expert_parallelism_keep_the_losses_and_scales_of_one_process(tmp_path, dispatch):
    """dp=2,ep=2: each rank runs its half of the experts with their global slots; after the amax
    reduction every rank holds every expert's scales, those of one process that ran them all."""
    with fake_te.installed():
        single = _train(tmp_path / "single", ["--fp8-experts", "--checkpoint-every", "1"])
    result = run_cli([*MOE, "--run-dir", str(tmp_path / "ep"), "--fp8-experts", "--checkpoint-every", "1",
                      "--mesh", "dp=2,ep=2", "--ep-dispatch", dispatch], nproc=2, module="tests.workers.with_fake_te")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    mesh = scalars(tmp_path / "ep")["train/loss"]
    for step, (a, e) in enumerate(zip(mesh, single), 1):
        assert abs(a - e) <= 2e-3 * e, f"step {step}: dp=2,ep=2 {a} vs one process {e}"
    one, two = (_fp8_state(tmp_path / run / "checkpoints" / "step_000001") for run in ("single", "ep"))
    for name in (k for k in one if k.endswith("experts.scale")):
        ratio = (two[name] / one[name]).view(-1, 3)
        torch.testing.assert_close(ratio[:, 1], torch.ones_like(ratio[:, 1]), rtol=2e-3, atol=0)  # weights


@pytest.mark.slow
def test_compiled_blocks_keep_the_fp8_experts_op_in_one_graph_and_the_eager_losses(tmp_path):
    """torch.compile with selective recompute (the aot_eager backend, as tests/integration/test_te_linear.py):
    the experts' op is one node of the block's graph, compiled once, and gives the eager losses."""
    with fake_te.installed():
        eager = _train(tmp_path / "eager", ["--fp8-experts", "--recompute", "selective"])
    env = {"STRICT_RECOMPILES": "1", "COMPILE_BACKEND": "aot_eager", "FAKE_TE_LOG": str(tmp_path / "calls")}
    result = run_cli([*MOE, "--run-dir", str(tmp_path / "compiled"), "--fp8-experts", "--compile", "--recompute",
                      "selective"], nproc=1, module="tests.workers.with_fake_te", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    compiled = scalars(tmp_path / "compiled")["train/loss"]
    assert len(compiled) == 2
    for step, (a, e) in enumerate(zip(compiled, eager), 1):
        assert abs(a - e) <= 1e-5 * e, f"step {step}: compiled {a} vs eager {e}"
    calls = [json.loads(line) for line in (tmp_path / "calls.0").read_text().splitlines()]
    # Selective recompute keeps the op's outputs: each block's experts run once a micro-batch.
    assert sum(1 for c in calls if c["op"] == "grouped_gemm" and c["layout"] == "TN") == 4 * 3 * 2 * 2


def test_training_with_fp8_experts_runs_every_moe_layers_experts_in_te_and_keeps_their_state(tmp_path):
    with fake_te.installed() as calls:
        bf16_experts = _train(tmp_path / "bf16", [])
        assert not any(c["op"] == "grouped_gemm" for c in calls)
        fp8_experts = _train(tmp_path / "fp8", ["--fp8-experts", "--checkpoint-every", "1"])
    layers = sum(1 for c in calls if c["op"] == "grouped_gemm" and c["layout"] == "TN") // (3 * 2 * 2)
    cfg = get_model_config("tiny-moe")
    assert layers == cfg.num_layers  # every block of tiny-moe is a MoE block
    # FP8's rounding in the experts, no more: the same model and data.
    for step, (a, e) in enumerate(zip(fp8_experts, bf16_experts), 1):
        assert a != e and abs(a - e) <= 1e-2 * e, f"step {step}: FP8 experts {a} vs bf16 experts {e}"
    saved = _fp8_state(tmp_path / "fp8" / "checkpoints" / "step_000001")
    assert saved["blocks.1.experts.scale"].shape == (3 * 3 * cfg.num_experts,)
    # After the first step's update: every expert's weight slots hold a scale from its amax.
    weight_scales = saved["blocks.1.experts.scale"].view(-1, 3)[:, 1]
    assert (weight_scales != 1).all()


def test_a_checkpoint_resumes_with_the_experts_switched_to_fp8_and_back(tmp_path):
    """The experts' scaling state is its own entries: a run resumed with --fp8-experts starts them
    afresh; one resumed without it leaves them in the checkpoint; the other layers' carry over."""
    with fake_te.installed():
        _train(tmp_path / "bf16", ["--checkpoint-every", "1"])
        resume = ["--resume", str(tmp_path / "bf16" / "checkpoints" / "step_000001"), "--checkpoint-every", "1"]
        _train(tmp_path / "on", [*resume, "--fp8-experts"])
        before = _fp8_state(tmp_path / "bf16" / "checkpoints" / "step_000001")
        after = _fp8_state(tmp_path / "on" / "checkpoints" / "step_000002")
        assert not any("experts" in name for name in before)
        assert after["blocks.0.experts.scale"].shape == (3 * 3 * get_model_config("tiny-moe").num_experts,)
        # The blocks' own history carried over: step 1's amaxes, one row further back after step 2.
        assert before["blocks.0.amax_history"][-1].abs().max() > 0
        assert torch.equal(after["blocks.0.amax_history"][-2], before["blocks.0.amax_history"][-1])
        _train(tmp_path / "off", ["--resume", str(tmp_path / "on" / "checkpoints" / "step_000002")])
