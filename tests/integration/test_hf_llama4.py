"""Hugging Face Llama 4 interop: dtrain on weights transformers saved, as Llama4ForCausalLM and as the
published Llama4ForConditionalGeneration (its vision tower left out), gives the text model's logits
and loss (chunked RoPE layers with the L2 qk-norm, NoPE layers with the temperature, interleaved
RoPE rows, dense and MoE blocks alternating, the sigmoid top-1 router scaling the expert's input,
the shared expert, Scout's RoPE scaling); 10 steps of --init-from-hf training give transformers'
losses, gradient norms and weights; HF -> dtrain -> HF is bit-exact, and transformers loads the
export with no missing or unexpected keys."""

from __future__ import annotations

import pytest

from tests.hf_training import assert_trains_like_transformers
from tools import hf_convert
from tests.unit.test_hf_llama4 import make_hf_llama4


# The `tiny-llama4` preset's shape.
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, attention_chunk_size=16,
            floor_scale=32)


@pytest.mark.slow
def test_ten_training_steps_match_transformers(tmp_path):
    model = make_hf_llama4(tmp_path / "hf", **TINY)
    cfg, _ = hf_convert.load_hf_params(tmp_path / "hf")
    assert_trains_like_transformers(tmp_path, tmp_path / "hf", model, cfg, "tiny-llama4")
