"""Hugging Face Llama 4 interop in one process: dtrain on weights transformers saved, as
Llama4ForCausalLM and as the published Llama4ForConditionalGeneration (its vision tower left out),
gives the text model's logits and loss; HF -> dtrain -> HF is bit-exact and transformers loads the
export; what dtrain cannot read is one line. Ten training steps against transformers:
tests/integration/test_hf_llama4.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.interop import hf
from models import llama4
from models.errors import UserError
from tests.unit.test_hf_convert import _assert_matches_transformers, _safetensors
from tools import hf_convert


transformers = pytest.importorskip("transformers")


SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}


VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vision_output_dim=16,
              projector_input_dim=16, projector_output_dim=16, image_size=28, patch_size=14)


def _text_config(**shape) -> dict:
    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=8, rope_parameters=SCOUT_ROPE)
    kw.update(shape)
    return kw


def make_hf_llama4(path: Path, *, published: bool = False, dtype=torch.float32, **shape):
    """A random Llama 4 saved with save_pretrained: Llama4ForCausalLM, or with `published` the
    Llama4ForConditionalGeneration of a tiny vision tower. Norms random, the router far from its init."""
    torch.manual_seed(0)
    text = _text_config(**shape)
    if published:
        config = transformers.Llama4Config(text_config=text, vision_config=VISION)
        model = transformers.Llama4ForConditionalGeneration(config).eval()
    else:
        model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**text)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "router" in name:
                p.normal_(0.0, 0.5)
    model = model.to(dtype)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("published", [False, True], ids=["causal-lm", "conditional-generation"])
def test_imported_llama4_gives_transformers_logits_and_loss(tmp_path, published):
    model = make_hf_llama4(tmp_path, published=published)
    cfg, params = hf_convert.load_hf_params(tmp_path)
    assert (cfg.layer_pattern, cfg.attention_chunk, cfg.moe_layers, cfg.floor_scale) == ("chunk-chunk-chunk-nope", 8,
                                                                                         (1, 3), 8)
    assert cfg.rope_scaling.low_freq_factor == cfg.rope_scaling.high_freq_factor == 1.0 and cfg.qk_l2_norm
    assert not any(name.startswith("vision") for name in params) and "blocks.0.mlp.w_gate" in params
    # transformers' ConditionalGeneration forward wants images; its text model is what runs on text.
    _assert_matches_transformers(model.language_model if published else model, params, cfg, llama4.forward)


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(tmp_path):
    source = tmp_path / "hf"
    make_hf_llama4(source, dtype=torch.bfloat16)
    hf_convert.import_hf(source, tmp_path / "run" / "checkpoints" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported")
    before, after = _safetensors(source), _safetensors(out)
    assert "model.layers.3.feed_forward.experts.gate_up_proj" in after and before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == torch.bfloat16, name
        assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    reloaded, info = transformers.Llama4ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    original = transformers.Llama4ForCausalLM.from_pretrained(source).eval()
    tokens = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=tokens).logits, original(input_ids=tokens).logits,
                                   rtol=0, atol=0)


def test_the_published_layout_exports_its_text_model(tmp_path):
    source = tmp_path / "hf"
    published = make_hf_llama4(source, published=True)
    hf_convert.import_hf(source, tmp_path / "run" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run" / "step_000000", tmp_path / "exported")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["moe_layers"]) == ("llama4_text",
                                                                                     ["Llama4ForCausalLM"], [1, 3])
    text, info = transformers.Llama4ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    tokens = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(text.eval()(input_ids=tokens).logits,
                                   published.language_model(input_ids=tokens).logits, rtol=0, atol=0)


def test_what_dtrain_cannot_read_is_a_one_line_error(tmp_path):
    make_hf_llama4(tmp_path / "hf", published=True)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    text = config["text_config"]
    for change, message in (
        ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "fbgemm_fp8-quantized .* \"-FP8\" repositories"),
        ({"text_config": {**text, "layer_types": ["chunked_attention"] * 4, "no_rope_layers": [1, 1, 1, 0]}},
         "layer 3 is chunked_attention without RoPE"),
        ({"text_config": {**text, "hidden_size": "32"}}, "hidden_size='32', which must be a positive integer"),
        ({"text_config": None}, "needs text_config"),
        # A listed layer past the last was passed over, a string was never a MoE layer, and any entry of
        # no_rope_layers that is not 0 counted as RoPE.
        ({"text_config": {**text, "moe_layers": [1, 3, 9]}}, r"moe_layers=\[1, 3, 9\] must list layers of 0 .. 3"),
        ({"text_config": {**text, "moe_layers": ["1", "3"]}}, r"moe_layers=\['1', '3'\] must list layers"),
        ({"text_config": {**text, "no_rope_layers": [1, 1, 1, 2]}}, r"must hold 1 \(RoPE\) or 0 \(NoPE\)"),
        ({"text_config": {**text, "no_rope_layers": "1110"}}, r"no_rope_layers='1110' must hold 1"),
    ):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=message):
            hf.HFCheckpoint(tmp_path / "hf")
