"""What the planner knows of MoE layouts: torchao's FP8 experts (faster than bf16 where each expert
has many rows of a wide matmul, slower where its casts outweigh the FP8 GEMMs), and the run's
startup line that says which."""

from __future__ import annotations

import logging

import attrs
import pytest

from dtrain.planner.hardware import H200
from dtrain.planner.steptime import predict_step
from models.presets import get_model_config
from tests.layouts import resolved


def _rows(model: str, micro_batch: int, seq_len: int = 4096) -> float:
    cfg = get_model_config(model)
    return micro_batch * seq_len * cfg.top_k / cfg.num_experts


def test_fp8_experts_pay_where_experts_are_wide_and_busy_and_not_where_they_are_narrow():
    mixtral, deepseek = get_model_config("mixtral-small"), get_model_config("deepseek-v2-lite")
    wide = H200.fp8_experts_gain(mixtral.num_experts, mixtral.dim, mixtral.expert_ffn_dim, _rows("mixtral-small", 2))
    narrow = H200.fp8_experts_gain(deepseek.num_experts, deepseek.dim, deepseek.expert_ffn_dim,
                                   _rows("deepseek-v2-lite", 2))
    assert wide > 1 > narrow
    # More rows per expert amortise the casts of each expert's weights.
    assert H200.fp8_experts_gain(mixtral.num_experts, mixtral.dim, mixtral.expert_ffn_dim,
                                 _rows("mixtral-small", 8)) > wide
    # With no cast costs the FP8 rate alone would win everywhere: the casts are what decides.
    free_casts = attrs.evolve(H200, fp8_expert_row_cast_bytes=0.0, fp8_expert_weight_cast_bytes=0.0)
    assert free_casts.fp8_experts_gain(deepseek.num_experts, deepseek.dim, deepseek.expert_ffn_dim,
                                       _rows("deepseek-v2-lite", 2)) > 1


@pytest.mark.parametrize("model,faster", [("mixtral-small", True), ("deepseek-v2-lite", False)])
def test_the_step_time_model_prices_fp8_experts(model, faster):
    flags = ["--model", model, "--model-overrides", "num_layers=4", "--seq-len", "4096", "--micro-batch", "2",
             "--global-batch", "8", "--compile"]
    bf16 = predict_step(resolved(flags)).seconds
    fp8 = predict_step(resolved([*flags, "--fp8-experts"])).seconds
    assert (fp8 < bf16) == faster, (bf16, fp8)


@pytest.mark.parametrize("model,level,words", [("mixtral-small", logging.INFO, "{:.2f}x as fast as bf16 experts"),
                                               ("deepseek-v2-lite", logging.WARNING, "slower than bf16 experts here "
                                                                                     "({:.2f}x")])
def test_a_run_says_at_start_whether_fp8_experts_should_pay(model, level, words, caplog):
    from dtrain.rank_model import _log_fp8_experts

    cfg = get_model_config(model)
    layout = resolved(["--model", model, "--seq-len", "4096", "--micro-batch", "2", "--fp8-experts"])
    gain = H200.fp8_experts_gain(cfg.num_experts, cfg.dim, cfg.expert_ffn_dim, _rows(model, 2))
    with caplog.at_level(logging.INFO, logger="dtrain"):
        _log_fp8_experts(layout)
    assert [r.levelno for r in caplog.records] == [level] and words.format(gain) in caplog.text, caplog.text
