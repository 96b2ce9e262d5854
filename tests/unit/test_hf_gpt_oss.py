"""Hugging Face gpt-oss interop: dtrain on weights transformers saved gives its logits and loss
(sinks, biases, windowed and full layers, YaRN not truncated, the biased router, the clamped
biased experts); 10 steps of --init-from-hf training give transformers' losses, gradient norms
and weights; HF -> dtrain -> HF is bit-exact in the fused layout and loads in transformers with
no missing or unexpected keys; MXFP4 experts are dequantized as transformers dequantizes them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from dtrain.interop import hf, mxfp4
from models import gpt_oss
from models.errors import UserError
from tests.unit.test_hf_convert import _assert_matches_transformers, _safetensors
from tools import hf_convert


transformers = pytest.importorskip("transformers")


def make_hf_gpt_oss(path: Path, dtype=torch.float32, **shape) -> "transformers.GptOssForCausalLM":
    """A random gpt-oss saved with save_pretrained. Norms random; biases, sinks and the router far
    from their init, so that each one's mapping changes the output."""
    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
              router_aux_loss_coef=0.02)
    kw.update(shape)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")) or "router" in name:
                p.normal_(0.0, 0.5)
    model = model.to(dtype)
    model.save_pretrained(path)
    return model


def test_imported_gpt_oss_gives_transformers_logits_and_loss(tmp_path):
    model = make_hf_gpt_oss(tmp_path)
    cfg, params = hf_convert.load_hf_params(tmp_path)
    assert (cfg.layer_pattern, cfg.sliding_window, cfg.head_dim, cfg.top_k) == ("window-full", 6, 16, 2)
    assert not cfg.rope_scaling.truncate and cfg.rope_scaling.factor == 32 and cfg.rope_theta == 150000
    assert params["blocks.1.moe.experts.w_gate"].shape == (4, 24, 32) and params["blocks.1.attn.wq"].shape == (64, 32)
    _assert_matches_transformers(model, params, cfg, gpt_oss.forward)  # 40 tokens, windows of 6


def test_round_trip_is_bit_exact_and_transformers_loads_the_export(tmp_path):
    source = tmp_path / "hf"
    make_hf_gpt_oss(source, dtype=torch.bfloat16)
    hf_convert.import_hf(source, tmp_path / "run" / "checkpoints" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported")
    before, after = _safetensors(source), _safetensors(out)
    assert "model.layers.1.mlp.experts.gate_up_proj_bias" in after and before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == torch.bfloat16, name
        assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    reloaded, info = transformers.GptOssForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    original = transformers.GptOssForCausalLM.from_pretrained(source).eval()
    tokens = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(input_ids=tokens).logits, original(input_ids=tokens).logits,
                                   rtol=0, atol=0)


def test_mxfp4_dequantization_is_transformers(tmp_path, caplog):
    """A hand-made MXFP4 tensor (every code, both nibbles, scales around 2^0) dequantizes as
    transformers' own integration does, bit for bit; a checkpoint of MXFP4 experts imports to the
    same parameters as one holding transformers' dequantization of them, with a log line."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 48, 1, 16), generator=generator, dtype=torch.uint8)  # [E, 2F, D/32, 16]
    scales = torch.randint(120, 134, (4, 48, 1), generator=generator, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone())  # [E, in, out]
    assert torch.equal(ours.view(torch.int16), theirs.transpose(1, 2).contiguous().view(torch.int16))
    assert set(ours.unique().abs().tolist()) > {0.0, 0.5, 6.0}

    from safetensors.torch import load_file, save_file

    make_hf_gpt_oss(tmp_path / "fused", dtype=torch.bfloat16, hidden_size=32, intermediate_size=32)
    tensors = load_file(tmp_path / "fused" / hf.SINGLE_FILE)
    quantized = dict(tensors)
    for i in range(2):
        prefix = f"model.layers.{i}.mlp.experts."
        for name, rows in (("gate_up_proj", 64), ("down_proj", 32)):
            b = torch.randint(0, 256, (4, rows, 1, 16), generator=generator, dtype=torch.uint8)
            s = torch.randint(122, 130, (4, rows, 1), generator=generator, dtype=torch.uint8)
            del quantized[prefix + name]
            quantized[prefix + name + "_blocks"], quantized[prefix + name + "_scales"] = b, s
            tensors[prefix + name] = convert_moe_packed_tensors(b.clone(), s.clone())
    (tmp_path / "mxfp4").mkdir()
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}}))
    save_file(quantized, tmp_path / "mxfp4" / hf.SINGLE_FILE)
    save_file(tensors, tmp_path / "fused" / hf.SINGLE_FILE)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        from_mxfp4, from_fused = (hf_convert.load_hf_params(tmp_path / d)[1] for d in ("mxfp4", "fused"))
    assert "its experts are MXFP4; they are dequantized to bfloat16 on import" in caplog.text
    for name in from_fused:
        assert torch.equal(from_mxfp4[name], from_fused[name]), name
    # An export writes the fused bf16 experts, without the quantization config.
    hf_convert.import_hf(tmp_path / "mxfp4", tmp_path / "run" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run" / "step_000000", tmp_path / "exported")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = _safetensors(out)
    assert exported.keys() == tensors.keys()
    assert all(torch.equal(exported[name], tensors[name]) for name in tensors)


def test_what_transformers_gpt_oss_cannot_hold_is_a_one_line_error(tmp_path):
    make_hf_gpt_oss(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    for change, message in (
        ({"quantization_config": {"quant_method": "fp8"}}, "fp8-quantized; dtrain reads gpt-oss in bf16, fp32 or its "
                                                           "published MXFP4 experts"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "must give each of the 2 layers sliding_attention"),
        ({"rope_parameters": {**config["rope_parameters"], "attention_factor": 2.0}}, "explicit attention_factor"),
    ):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=message):
            hf.HFCheckpoint(tmp_path / "hf")
    config_path.write_text(json.dumps(config))
    cfg, _ = hf_convert.load_hf_params(tmp_path / "hf")
    import attrs

    for change, message in ((dict(attention_sinks=False), "attention_sinks=False"),
                            (dict(layer_pattern="window-chunk", attention_chunk=8), "window and full layers only")):
        with pytest.raises(UserError, match=f"no Hugging Face gpt-oss equivalent: .*{message}"):
            hf.config_to_hf(attrs.evolve(cfg, **change), torch.bfloat16)


@pytest.mark.parametrize("blocks,scales", [
    ((), ()), ((16,), ()), ((4, 64, 16), (4, 64)), ((4, 64, 1, 8), (4, 64, 1)), ((4, 64, 1, 16), (4, 64, 2)),
], ids=["scalar", "one-dim", "no-block-dim", "half-blocks", "other-scales"])
def test_mxfp4_blocks_that_do_not_fit_their_scales_are_one_line(tmp_path, blocks, scales):
    """Crafted MXFP4 experts of shapes the format has no place for: one line naming the tensor and
    its file (an IndexError traceback where the blocks had fewer than two dims)."""
    from safetensors.torch import load_file, save_file

    make_hf_gpt_oss(tmp_path, dtype=torch.bfloat16, intermediate_size=32)
    tensors = load_file(tmp_path / hf.SINGLE_FILE)
    generator = torch.Generator().manual_seed(0)
    for i in range(2):
        prefix = f"model.layers.{i}.mlp.experts."
        for name, rows in (("gate_up_proj", 64), ("down_proj", 32)):
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"] = torch.randint(0, 256, (4, rows, 1, 16), generator=generator,
                                                               dtype=torch.uint8)
            tensors[prefix + name + "_scales"] = torch.full((4, rows, 1), 127, dtype=torch.uint8)
    hf_convert.load_hf_params(tmp_path)  # well formed, it imports
    bad = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[bad + "_blocks"] = torch.randint(0, 256, blocks, generator=generator, dtype=torch.uint8)
    tensors[bad + "_scales"] = torch.full(scales, 127, dtype=torch.uint8)
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(UserError) as refused:
        hf_convert.load_hf_params(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / hf.SINGLE_FILE}: {bad}_blocks") and "\n" not in message, message
