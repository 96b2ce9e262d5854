"""What the planner knows of MoE layouts: torchao's FP8 experts (measured slower than bf16 ones on
an H200 at mixtral-small's shape, the more so where each expert has few rows of a narrow matmul, so
that the casts outweigh the FP8 GEMMs), and the run's startup line that says which."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import pytest

from dtrain.planner import measured
from dtrain.planner.hardware import H200
from dtrain.planner.steptime import predict_step
from models.presets import get_model_config
from tests.layouts import resolved

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results.jsonl"


def _rows(model: str, micro_batch: int, seq_len: int = 4096) -> float:
    cfg = get_model_config(model)
    return micro_batch * seq_len * cfg.top_k / cfg.num_experts


def _measured_fp8_experts_pair() -> tuple[dict, dict]:
    """The newest whole-step mixtral-small row with torchao's FP8 experts, and the bf16 row of the
    same call and batch."""
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    fp8 = [r for r in rows if r["model"] == "mixtral-small" and r["mesh"] == "single" and "--fp8-experts" in r["args"]
           and "te" not in r["args"]][-1]
    bf16 = next(r for r in reversed(rows) if r.get("call") == fp8["call"] and r["model"] == "mixtral-small"
                and "--fp8-experts" not in r["args"] and r["micro_batch"] == fp8["micro_batch"]
                and r["global_batch"] == fp8["global_batch"])
    return fp8, bf16


def test_the_fp8_experts_gain_is_what_the_gpu_measured_and_grows_with_rows_and_free_casts():
    fp8, bf16 = _measured_fp8_experts_pair()
    predicted = [predict_step(measured.row_layout(
        ["--model", row["model"], "--seq-len", str(row["seq_len"]), "--micro-batch", str(row["micro_batch"]),
         "--global-batch", str(row["global_batch"]), *measured.run_options(row)], row["gpus"])).tokens_per_sec_per_gpu
        for row in (fp8, bf16)]
    measured_ratio = fp8["tokens_per_sec_per_gpu"] / bf16["tokens_per_sec_per_gpu"]
    assert abs(predicted[0] / predicted[1] / measured_ratio - 1) < 0.1, (predicted, measured_ratio)
    mixtral, deepseek = get_model_config("mixtral-small"), get_model_config("deepseek-v2-lite")
    wide = H200.fp8_experts_gain(mixtral.num_experts, mixtral.dim, mixtral.expert_ffn_dim,
                                 _rows("mixtral-small", fp8["micro_batch"]))
    assert wide < 1
    narrow = H200.fp8_experts_gain(deepseek.num_experts, deepseek.dim, deepseek.expert_ffn_dim,
                                   _rows("deepseek-v2-lite", 2))
    assert narrow < wide
    # More rows per expert amortise the casts of each expert's weights.
    assert H200.fp8_experts_gain(mixtral.num_experts, mixtral.dim, mixtral.expert_ffn_dim,
                                 _rows("mixtral-small", 8)) > wide
    # Casts are a cost: without them the same kernel gains more.
    free_casts = attrs.evolve(H200, fp8_expert_row_cast_bytes=0.0, fp8_expert_weight_cast_bytes=0.0)
    assert free_casts.fp8_experts_gain(deepseek.num_experts, deepseek.dim, deepseek.expert_ffn_dim,
                                       _rows("deepseek-v2-lite", 2)) > narrow


# A GPU whose FP8 grouped GEMM ran as efficiently as its bf16 one: there FP8 experts pay on
# mixtral-small's wide experts.
EFFICIENT_FP8_EXPERTS = attrs.evolve(H200, fp8_grouped_gemm_efficiency=H200.grouped_gemm_efficiency)


@pytest.mark.parametrize("model,hardware,faster", [("mixtral-small", H200, False), ("deepseek-v2-lite", H200, False),
                                                   ("mixtral-small", EFFICIENT_FP8_EXPERTS, True)],
                         ids=["mixtral-small", "deepseek-v2-lite", "mixtral-small-efficient-fp8"])
def test_the_step_time_model_prices_fp8_experts(model, hardware, faster):
    flags = ["--model", model, "--model-overrides", "num_layers=4", "--seq-len", "4096", "--micro-batch", "2",
             "--global-batch", "8", "--compile"]
    bf16 = predict_step(resolved(flags), hardware).seconds
    fp8 = predict_step(resolved([*flags, "--fp8-experts"]), hardware).seconds
    assert (fp8 < bf16) == faster, (bf16, fp8)


@pytest.mark.parametrize("model,hardware,level,words", [
    ("mixtral-small", EFFICIENT_FP8_EXPERTS, logging.INFO, "{:.2f}x as fast as bf16 experts"),
    ("mixtral-small", H200, logging.WARNING, "slower than bf16 experts here ({:.2f}x"),
    ("deepseek-v2-lite", H200, logging.WARNING, "slower than bf16 experts here ({:.2f}x")],
    ids=["mixtral-small-efficient-fp8", "mixtral-small", "deepseek-v2-lite"])
def test_a_run_says_at_start_whether_fp8_experts_should_pay(model, hardware, level, words, caplog, monkeypatch):
    from dtrain.planner import gpus
    from dtrain.rank_model import _log_fp8_experts

    monkeypatch.setattr(gpus, "profile", lambda name: hardware)
    cfg = get_model_config(model)
    layout = resolved(["--model", model, "--seq-len", "4096", "--micro-batch", "2", "--fp8-experts"])
    gain = hardware.fp8_experts_gain(cfg.num_experts, cfg.dim, cfg.expert_ffn_dim, _rows(model, 2))
    with caplog.at_level(logging.INFO, logger="dtrain"):
        _log_fp8_experts(layout)
    assert [r.levelno for r in caplog.records] == [level] and words.format(gain) in caplog.text, caplog.text
