"""Hugging Face DeepSeek-V3 interop: dtrain on weights transformers saved gives its logits and loss
(MLA with and without query compression, YaRN, interleaved RoPE rows, group-limited sigmoid
routing with the selection bias, shared experts, a dense first layer); dtrain's MTP module on
DeepSeek's published MTP layout gives the loss of transformers' own MTP layer; HF -> dtrain -> HF
is bit-exact, MTP module and its copies of the shared weights included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import storage
from dtrain.interop import hf
from models import deepseek, spec
from models.context import LocalContext
from models.errors import UserError
from models.mtp import MTPStats
from tests.unit.test_hf_convert import _assert_matches_transformers, _safetensors
from tools import hf_convert


transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def _config(*, q_lora: int | None = 48, rope: dict | None = None, interleave: bool = True, layers: int = 3):
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=q_lora, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64, rope_interleave=interleave,
        rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}, tie_word_embeddings=False)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Random norms and a router far from uniform with a nonzero selection bias, so that a wrong
    norm, expert order, group choice or bias changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)


def make_hf_deepseek(path: Path, *, fused: bool = False, dtype=torch.float32, max_shard_size: str | None = None,
                     **config) -> "transformers.DeepseekV3ForCausalLM":
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(_config(**config)).eval()
    _randomise(model, 1)
    model = model.to(dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra, **({"save_original_format": False} if fused else {}))
    return model


CASES = [({}, False), ({"q_lora": None, "interleave": False}, True), ({"rope": YARN}, False)]


@pytest.mark.parametrize("config,fused", CASES, ids=["q-lora-interleaved", "no-q-lora-half-rope-fused", "yarn"])
def test_imported_deepseek_v3_gives_transformers_logits_and_loss(tmp_path, config, fused):
    model = make_hf_deepseek(tmp_path, fused=fused, **config)
    assert any("gate_up_proj" in n for n in _safetensors(tmp_path)) == fused
    cfg, params = hf_convert.load_hf_params(tmp_path)
    # transformers writes num_nextn_predict_layers=1 but saves no MTP module: none is imported.
    assert cfg.mtp_depth == 0 and not any(name.startswith("mtp.") for name in params)
    assert (cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor, cfg.score_func) == (4, 2, 2.5, "sigmoid")
    assert cfg.q_lora_rank == (config.get("q_lora", 48) or 0)
    assert (cfg.rope_scaling is not None) == ("rope" in config)
    assert params["blocks.2.moe.router_bias"].abs().sum() > 0
    _assert_matches_transformers(model, params, cfg, deepseek.forward)


def _published_mtp_tensors(model, mtp_layer, num_layers: int) -> dict[str, torch.Tensor]:
    """transformers' MTP layer in DeepSeek's published layout: layer L, experts one per tensor,
    with copies of the embedding and output head."""
    prefix, out = f"model.layers.{num_layers}.", {}
    for name, value in mtp_layer.state_dict().items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for j in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{j}.gate_proj.weight"] = gate[j].clone()
                out[f"{prefix}mlp.experts.{j}.up_proj.weight"] = up[j].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for j in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{j}.down_proj.weight"] = value[j].clone()
        else:
            out[prefix + name] = value.clone()
    out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def _with_hf_mtp_layer(path: Path, dtype=torch.float32):
    """A transformers DeepSeek-V3 and its own MTP layer (`transformers.modeling_layers.MtpLayer`),
    saved as DeepSeek publishes them."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    model = make_hf_deepseek(path, dtype=dtype)
    torch.manual_seed(2)
    layer = MtpLayer(model.config, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, model.config.num_hidden_layers)
    with torch.no_grad():  # outside a PreTrainedModel nothing initialises the experts
        for param in layer.parameters():
            param.normal_(0.0, 0.02)
    _randomise(layer, 3)
    layer = layer.to(dtype).eval()
    tensors = load_file(path / hf.SINGLE_FILE)
    tensors.update(_published_mtp_tensors(model, layer, model.config.num_hidden_layers))
    save_file(tensors, path / hf.SINGLE_FILE, metadata={"format": "pt"})
    return model, layer


def test_mtp_module_gives_the_loss_of_transformers_mtp_layer(tmp_path):
    model, layer = _with_hf_mtp_layer(tmp_path)
    cfg, params = hf_convert.load_hf_params(tmp_path)
    assert cfg.mtp_depth == 1 and params["mtp.0.eh_proj"].shape == (64, 128)
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(4))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        # transformers: the main model's last (normed) hidden state, and the embedding of the next token.
        hidden = model.model(input_ids=inputs).last_hidden_state
        positions = torch.arange(inputs.shape[1])[None]
        rope = model.model.rotary_emb(hidden, positions)
        out = layer(model.model.embed_tokens(labels), hidden, position_embeddings=rope, attention_mask=None,
                    position_ids=positions, cache=None)
        logits = model.lm_head(out)[:, :-1]
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten(), reduction="sum")
        stats = MTPStats()
        deepseek.forward(spec.unflatten(params), inputs, labels, cfg, LocalContext(), mtp_stats=stats)
    loss_sum, count = stats.totals[0].tolist()
    assert count == 2 * 31
    assert abs(loss_sum - expected.item()) <= 1e-5 * expected.item(), (loss_sum, expected.item())


def test_round_trip_with_mtp_is_bit_exact_in_the_published_layout(tmp_path):
    source = tmp_path / "hf"
    _with_hf_mtp_layer(source, dtype=torch.bfloat16)
    hf_convert.import_hf(source, tmp_path / "run" / "checkpoints" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported", max_shard_bytes=200_000)
    assert (out / hf.INDEX_FILE).is_file()
    before, after = _safetensors(source), _safetensors(out)
    assert "model.layers.3.shared_head.head.weight" in after and "model.layers.3.mlp.experts.7.down_proj.weight" in after
    assert before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == torch.bfloat16, name
        assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    config = json.loads((out / "config.json").read_text())
    assert (config["num_nextn_predict_layers"], config["n_group"], config["rope_interleave"]) == (1, 4, True)
    # transformers reads the exported config back to the same model (it leaves the MTP layer aside).
    original, reloaded = (transformers.DeepseekV3ForCausalLM.from_pretrained(p).eval() for p in (source, out))
    tokens = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, original(input_ids=tokens).logits, rtol=0, atol=0)


def test_what_transformers_deepseek_v3_cannot_hold_is_a_one_line_error(tmp_path, capsys):
    make_hf_deepseek(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_key_value_heads": 2}))
    with pytest.raises(UserError, match="num_key_value_heads=2 but MLA has one key and value per head"):
        hf.HFCheckpoint(tmp_path / "hf")
    config_path.write_text(json.dumps({**config, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e4}}))
    with pytest.raises(UserError, match="RoPE .* is not supported; dtrain's DeepSeek has plain RoPE and YaRN"):
        hf.HFCheckpoint(tmp_path / "hf")
    config_path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8",
                                                                         "weight_block_size": [128, 128]}}))
    with pytest.raises(UserError, match="fp8-quantized .* convert them to bf16 first"):
        hf.HFCheckpoint(tmp_path / "hf")
    config_path.write_text(json.dumps(config))
    checkpoint = hf_convert.import_hf(tmp_path / "hf", tmp_path / "run" / "step_000000")
    # DeepSeek-V2-Lite routes by softmax, which transformers' DeepSeek-V3 cannot.
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["model"]["score_func"] = "softmax"
    storage.write_meta(checkpoint, meta)  # with COMPLETE's checksum of it
    capsys.readouterr()
    assert hf_convert.main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf_convert: error: this DeepSeek model routes by softmax") and "\n" not in err, err
    assert not (tmp_path / "out").exists()
