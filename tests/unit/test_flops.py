"""Model FLOPs per token (the MFU numerator) and the metrics helpers."""

from __future__ import annotations

import attrs
import torch

from dtrain.metrics import format_line, peak_flops, peak_memory_gb
from models.flops import flops_per_token, matmul_params
from models.presets import get_model_config


# llama-1b shape numbers, written out here rather than read from the preset.
D, L, HEADS, KV_HEADS, FFN, VOCAB = 2048, 16, 32, 8, 8192, 128256
HEAD_DIM = D // HEADS
SEQ = 4096


def _hand_matmul_params() -> int:
    q = D * D
    k = v = D * (KV_HEADS * HEAD_DIM)
    o = D * D
    ffn = 3 * D * FFN
    head = VOCAB * D          # the output head; the input embedding is a lookup, not a matmul
    return L * (q + k + v + o + ffn) + head


def test_preset_matches_the_shape_numbers():
    cfg = get_model_config("llama-1b")
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (
        D, L, HEADS, KV_HEADS, FFN, VOCAB)
    assert not cfg.tie_embeddings


def test_llama_1b_matmul_params_and_flops():
    cfg = get_model_config("llama-1b")
    n = _hand_matmul_params()
    assert n == 1_235_746_816
    assert matmul_params(cfg) == n
    assert flops_per_token(cfg, SEQ) == 6 * n + 12 * L * D * SEQ


def test_tied_preset_counts_head_once():
    tied = get_model_config("llama3.2-1b")
    assert tied.tie_embeddings
    assert matmul_params(tied) == _hand_matmul_params()
    assert flops_per_token(tied, SEQ) == 6 * _hand_matmul_params() + 12 * L * D * SEQ
    untied = attrs.evolve(tied, tie_embeddings=False)
    assert matmul_params(untied) == matmul_params(tied)


def test_flops_grow_linearly_with_sequence():
    cfg = get_model_config("llama-1b")
    assert flops_per_token(cfg, 2 * SEQ) - flops_per_token(cfg, SEQ) == 12 * L * D * SEQ


def test_peak_flops_none_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_peak_memory_positive_on_cpu():
    assert peak_memory_gb(torch.device("cpu")) > 0


SCALARS = {
    "train/loss": 2.345678,
    "train/lr": 3e-4,
    "train/grad_norm": 0.12345,
    "perf/tokens_per_sec_per_gpu": 12345.6,
    "mem/peak_gb": 1.234,
}


def test_format_line_with_mfu():
    line = format_line(7, 100, {**SCALARS, "perf/mfu": 41.23})
    parts = line.split(" | ")
    assert parts == ["step   7/100", "loss 2.3457", "lr 3.00e-04", "grad norm 0.123", "tok/s/GPU 12,346",
                     "MFU 41.2%", "mem 1.23 GB"]


def test_format_line_without_mfu():
    line = format_line(100, 100, SCALARS)
    assert "MFU" not in line
    for piece in ("step 100/100", "loss 2.3457", "lr 3.00e-04", "grad norm 0.123", "tok/s/GPU 12,346",
                  "mem 1.23 GB"):
        assert piece in line
    assert line.split(" | ")[-1] == "mem 1.23 GB"


def test_format_line_off_a_gpu_gives_the_runs_throughput_without_a_gpu_unit():
    line = format_line(100, 100, {**SCALARS, "perf/tokens_per_sec": 24691.2}, per_gpu=False)
    assert "tok/s 24,691" in line.split(" | ") and "GPU" not in line and "MFU" not in line


def test_document_attention_flops_count_the_attended_keys():
    cfg = get_model_config("llama-1b")
    # One causal document per row: (S + 1) / 2 keys per query, half the convention's attention term
    # plus half a key.
    causal = flops_per_token(cfg, SEQ, attended_keys=(SEQ + 1) / 2)
    assert flops_per_token(cfg, SEQ) - causal == 12 * L * D * (SEQ - 1) / 2
    assert flops_per_token(cfg, SEQ, attended_keys=0) == 6 * matmul_params(cfg)


def test_attention_flops_count_the_heads_width_not_dim():
    from models import flops

    cfg = get_model_config("tiny")
    wide = get_model_config("tiny", "head_dim=32")  # 4 heads x 32: queries twice the 64 of dim
    assert flops.attention_flops_per_token(cfg, 100) == 12 * cfg.num_layers * cfg.dim * 100
    assert flops.attention_flops_per_token(wide, 100) == 2 * flops.attention_flops_per_token(cfg, 100)


def test_windowed_and_chunked_layers_count_the_keys_they_attend():
    """By layer kind: a full layer the whole sequence (the convention), a windowed one its window, a
    chunked one its chunk, each at most the sequence; NoPE layers attend as full ones."""
    cfg = get_model_config("llama-1b")
    full = flops_per_token(cfg, SEQ) - 6 * matmul_params(cfg)
    per_layer_and_key = full / (L * SEQ)
    mixed = attrs.evolve(cfg, layer_pattern="window-full-chunk-nope", sliding_window=128, attention_chunk=1024)
    attention = flops_per_token(mixed, SEQ) - 6 * matmul_params(mixed)
    assert attention == per_layer_and_key * L / 4 * (128 + SEQ + 1024 + SEQ)
    long_windows = attrs.evolve(mixed, sliding_window=10 * SEQ, attention_chunk=10 * SEQ)
    assert flops_per_token(long_windows, SEQ) == flops_per_token(cfg, SEQ)
