"""Hugging Face Qwen3 and Qwen3-MoE interop: dtrain on weights transformers saved gives its logits
and loss (heads wider than hidden_size / heads, qk-norm, tied embeddings; the hub's and the fused
expert layouts, mlp_only_layers and decoder_sparse_step, norm_topk_prob either way); ten training
steps from an import follow transformers + torch AdamW on the same batches; HF -> dtrain -> HF is
bit-exact and transformers loads the export with no missing or unexpected keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain.interop import hf
from models import llama, mixtral
from tests.unit.test_hf_convert import _assert_matches_transformers, _safetensors
from tools import hf_convert


transformers = pytest.importorskip("transformers")


def make_hf_qwen3(path: Path, *, moe: bool = False, fused: bool = False, dtype=torch.float32,
                  max_shard_size: str | None = None, **shape):
    """A random small Qwen3 (or Qwen3-MoE) saved with save_pretrained: the hub's per-expert tensors,
    or with `fused` transformers 5's in-memory layout. Random norms (qk-norm's too) and a router
    far from uniform, so that a wrong norm or expert order changes the output."""
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)
    if moe:
        kw.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    kw.update(shape)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta", 1e6)}
    torch.manual_seed(0)
    config = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**kw)
    model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    model = model.to(dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra, **({"save_original_format": False} if fused else {}))
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_imported_qwen3_gives_transformers_logits_and_loss(tmp_path, tie):
    model = make_hf_qwen3(tmp_path, tie_word_embeddings=tie)
    cfg, params = hf_convert.load_hf_params(tmp_path)
    # 4 heads x 16 = 64-wide queries from a 32-wide residual; qk-norm weights [head_dim].
    assert (cfg.qk_norm, cfg.head_dim, cfg.tie_embeddings) == (True, 16, tie)
    assert params["blocks.0.attn.wq"].shape == (64, 32) and params["blocks.0.attn.q_norm"].shape == (16,)
    _assert_matches_transformers(model, params, cfg, llama.forward)


def test_a_qwen3_config_without_head_dim_reads_transformers_default_of_128(tmp_path):
    make_hf_qwen3(tmp_path / "hf", hidden_size=64, num_attention_heads=2, head_dim=128)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["head_dim"]  # transformers' Qwen3Config then has 128, not 64 / 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert hf.HFCheckpoint(tmp_path / "hf").config.head_dim == 128


MOE_CASES = [(False, {}), (True, {"mlp_only_layers": [1]}), (False, {"decoder_sparse_step": 2, "norm_topk_prob": False}),
             (True, {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})]


@pytest.mark.parametrize("fused,shape", MOE_CASES, ids=["hub", "fused-mlp-only", "sparse-step-unnormed",
                                                        "fused-step-and-mlp-only"])
def test_imported_qwen3_moe_gives_transformers_logits_and_loss(tmp_path, fused, shape):
    model = make_hf_qwen3(tmp_path, moe=True, fused=fused, **shape)
    names = _safetensors(tmp_path).keys()
    assert any("gate_up_proj" in n for n in names) == fused
    cfg, params = hf_convert.load_hf_params(tmp_path)
    moe_layers = tuple(i for i, layer in enumerate(model.model.layers)
                       if isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock))
    assert cfg.moe_layers == moe_layers and len(moe_layers) < cfg.num_layers or not shape
    assert cfg.route_norm == shape.get("norm_topk_prob", True) and cfg.qk_norm and cfg.head_dim == 16
    # transformers' pooled coefficient 0.001, per MoE layer: x top_k / MoE layers.
    assert cfg.aux_loss_coef == pytest.approx(0.001 * 2 / len(moe_layers))
    _assert_matches_transformers(model, params, cfg, mixtral.forward)


def test_round_trips_are_bit_exact_and_transformers_loads_the_export(tmp_path):
    """Dense and MoE (from either expert layout), bf16 and sharded: HF -> dtrain checkpoint -> HF
    gives the hub's tensors bit for bit, and from_pretrained finds every key and no other."""
    cases = [("dense", {}, False), ("moe", {"moe": True, "mlp_only_layers": [1]}, False),
             ("moe-fused", {"moe": True, "mlp_only_layers": [1]}, True)]
    for name, kw, fused in cases:
        source = tmp_path / name
        make_hf_qwen3(source, dtype=torch.bfloat16, max_shard_size="40KB", fused=fused, **kw)
        hf_convert.import_hf(source, tmp_path / f"run-{name}" / "checkpoints" / "step_000000")
        out = hf_convert.export_hf(tmp_path / f"run-{name}", tmp_path / f"out-{name}", max_shard_bytes=50_000)
        hub = _safetensors(tmp_path / "moe" if fused else source)
        after = _safetensors(out)
        assert hub.keys() == after.keys(), name
        for key in hub:
            assert after[key].dtype == torch.bfloat16 and torch.equal(hub[key].view(torch.int16),
                                                                      after[key].view(torch.int16)), (name, key)
        cls = transformers.Qwen3MoeForCausalLM if kw else transformers.Qwen3ForCausalLM
        reloaded, info = cls.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
        original = cls.from_pretrained(source).eval()
        tokens = torch.randint(0, 97, (1, 24))
        with torch.no_grad():
            torch.testing.assert_close(reloaded.eval()(input_ids=tokens).logits, original(input_ids=tokens).logits,
                                       rtol=0, atol=0)
    config = json.loads((tmp_path / "out-moe" / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["mlp_only_layers"], config["router_aux_loss_coef"],
            config["head_dim"]) == ("qwen3_moe", 4, [1], 0.001, 16)
