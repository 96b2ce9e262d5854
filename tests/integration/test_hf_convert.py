"""Hugging Face interop (Llama and Mixtral): dtrain on imported weights gives transformers' logits
and loss; HF -> dtrain checkpoint -> HF is bit-exact; --init-from-hf trains from such weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import TINY_ARGS, run_cli, train_scalars
from tools import hf_convert
from tests.unit.test_hf_convert import transformers, make_hf_model, make_hf_mixtral


def _tiny_hf(path: Path) -> "transformers.LlamaForCausalLM":
    # The `tiny` preset's shape, so the CLI's --model tiny takes these weights.
    return make_hf_model(path, vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


def _first_step_loss(model) -> float:
    """transformers' mean loss on step 0's global batch of the CLI's tiny run (bundled data,
    seq 64, global batch 8): what dtrain logs at step 1, before the first update."""
    from dtrain.data import TokenDataset

    dataset = TokenDataset("bundled", None, 64, 2048, 0)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, labels in dataset.micro_batches(0, 8, 2, 0, 1):
            logits = model(input_ids=inputs).logits
            loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            tokens += labels.numel()
    return loss_sum / tokens


@pytest.mark.slow
def test_init_from_hf_on_tp2_and_resume_from_an_import_give_the_hf_loss(tmp_path):
    source = tmp_path / "hf"
    model = _tiny_hf(source)
    # The loss logged at step 1 is that of the weights before the first update, on step 0's batch.
    expected = _first_step_loss(model)
    tp = train_scalars(tmp_path / "tp", ["--mesh", "tp=2", "--steps", "1", "--init-from-hf", str(source)], nproc=2)
    assert abs(tp["train/loss"][0] - expected) <= 1e-5 * expected, (tp["train/loss"], expected)
    imported = hf_convert.import_hf(source, tmp_path / "imported" / "step_000000")
    single = train_scalars(tmp_path / "single", ["--steps", "1", "--resume", str(imported)])
    assert abs(single["train/loss"][0] - expected) <= 1e-5 * expected, (single["train/loss"], expected)


def test_init_from_hf_with_another_shape_names_the_overrides(tmp_path):
    make_hf_model(tmp_path)
    result = run_cli([*TINY_ARGS, "--run-dir", str(tmp_path / "run"), "--init-from-hf", str(tmp_path)])
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("dtrain: error: ") and "add --model-overrides dim=32," in line, result.stderr


# The `tiny-moe` preset's shape, so the CLI's --model tiny-moe takes these weights.
TINY_MOE = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0)


def test_init_from_hf_trains_mixtral_from_the_hf_loss(tmp_path):
    """--model tiny-moe with its own aux-loss coefficient and a selection bias (which HF has not:
    it starts at zero) takes the weights; the loss before the first update is transformers'."""
    source = tmp_path / "hf"
    model = make_hf_mixtral(source, **TINY_MOE)
    expected = _first_step_loss(model)
    run = train_scalars(tmp_path / "run", ["--model", "tiny-moe", "--model-overrides", "bias_update_rate=0.001",
                                           "--steps", "1", "--init-from-hf", str(source)])
    assert abs(run["train/loss"][0] - expected) <= 1e-5 * expected, (run["train/loss"], expected)
