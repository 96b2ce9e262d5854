"""Hugging Face gpt-oss interop: dtrain on weights transformers saved gives its logits and loss
(sinks, biases, windowed and full layers, YaRN not truncated, the biased router, the clamped
biased experts); 10 steps of --init-from-hf training give transformers' losses, gradient norms
and weights; HF -> dtrain -> HF is bit-exact in the fused layout and loads in transformers with
no missing or unexpected keys; MXFP4 experts are dequantized as transformers dequantizes them."""

from __future__ import annotations

import pytest

from tests.hf_training import assert_trains_like_transformers
from tools import hf_convert
from tests.unit.test_hf_gpt_oss import make_hf_gpt_oss


# The `tiny-gpt-oss` preset's shape: q heads twice dim wide, windows of 16 on even layers.
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16)


@pytest.mark.slow
def test_ten_training_steps_match_transformers(tmp_path):
    model = make_hf_gpt_oss(tmp_path / "hf", **TINY)
    cfg, _ = hf_convert.load_hf_params(tmp_path / "hf")
    # transformers leaves the load-balancing loss out of its loss unless asked for router logits.
    assert_trains_like_transformers(tmp_path, tmp_path / "hf", model, cfg, "tiny-gpt-oss", "aux_loss_coef=0")
