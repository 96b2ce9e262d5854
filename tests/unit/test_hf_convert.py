"""Hugging Face interop (Llama and Mixtral): dtrain on imported weights gives transformers' logits
and loss; HF -> dtrain checkpoint -> HF is bit-exact; --init-from-hf trains from such weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest
import torch

from dtrain.checkpoint import storage as ckpt
from dtrain.interop import hf
from models import families, llama, mixtral, spec
from models.context import LocalContext
from models.errors import UserError
from models.layers import rms_norm
from models.presets import PRESETS
from tools import hf_convert


transformers = pytest.importorskip("transformers")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def make_hf_model(path: Path, *, tie: bool = False, rope: dict | None = None, rope_theta: float = 5000.0,
                  dtype=torch.float32, max_shard_size: str | None = None, **shape) -> "transformers.LlamaForCausalLM":
    """A random small Llama saved with save_pretrained; norms are random too, so their mapping counts."""
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=tie)
    kw.update(shape)
    kw["rope_parameters"] = {"rope_theta": rope_theta, **(rope or {"rope_type": "default"})}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


@pytest.mark.parametrize("tie,rope", [(False, None), (True, LLAMA3_ROPE)], ids=["untied", "tied-llama3-rope"])
def test_imported_weights_give_transformers_logits_and_loss(tmp_path, tie, rope):
    model = make_hf_model(tmp_path, tie=tie, rope=rope)
    cfg, params = hf_convert.load_hf_params(tmp_path)
    assert cfg.tie_embeddings == tie and (cfg.rope_scaling is not None) == (rope is not None)
    assert ("head.output" in params) != tie
    _assert_matches_transformers(model, params, cfg, llama.forward)


def test_imported_llama_with_heads_wider_than_dim_over_heads_gives_transformers_logits(tmp_path):
    model = make_hf_model(tmp_path, head_dim=16)  # 4 heads x 16 = 64 from a 32-wide residual
    cfg, params = hf_convert.load_hf_params(tmp_path)
    assert cfg.head_dim == 16 and params["blocks.0.attn.wo"].shape == (32, 64)
    _assert_matches_transformers(model, params, cfg, llama.forward)
    # A head_dim that is dim / heads reads as unset, so the model follows its dim as the presets do.
    make_hf_model(tmp_path / "plain", head_dim=8)
    assert hf.HFCheckpoint(tmp_path / "plain").config.explicit_head_dim is None


def _assert_matches_transformers(model, params, cfg, forward) -> None:
    """dtrain's logits and summed loss on the imported weights equal transformers' (fp32)."""
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=tokens, labels=tokens)
        # dtrain's labels are already the next tokens; HF shifts inside. The last position has none.
        labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
        loss_sum = forward(spec.unflatten(params), tokens, labels, cfg, LocalContext())
        logits = _dtrain_logits(params, tokens, cfg)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
    n_tokens = tokens.numel() - tokens.shape[0]
    torch.testing.assert_close(loss_sum, expected.loss * n_tokens, rtol=1e-6, atol=1e-5)


def _dtrain_logits(params, tokens, cfg):
    """The layers' forward functions up to the head, then the head's norm and output matmul."""
    tree, ctx = spec.unflatten(params), LocalContext()
    aux = attrs.evolve(families.make_aux(cfg, torch.arange(tokens.shape[1])),
                       masks=llama.one_document_masks(cfg, ctx, *tokens.shape))
    x = tokens
    for layer in families.layers(cfg)[:-1]:
        x = layer.forward(llama._lookup(tree, layer.name), x, aux, ctx)
    output = tree["head"].get("output", tree["embed"]["weight"])
    return ctx.linear(rms_norm(x, tree["head"]["norm"], cfg.norm_eps), output)


def test_round_trip_through_a_dtrain_checkpoint_is_bit_exact(tmp_path):
    from safetensors.torch import load_file

    source = tmp_path / "hf"
    # bf16 and sharded with an index, as published checkpoints are.
    make_hf_model(source, rope=LLAMA3_ROPE, dtype=torch.bfloat16, max_shard_size="20KB")
    assert (source / hf.INDEX_FILE).is_file()
    dtrain_dir = hf_convert.import_hf(source, tmp_path / "run" / "checkpoints" / "step_000000")
    assert (dtrain_dir / "COMPLETE").is_file()
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported", max_shard_bytes=30_000)
    assert (out / hf.INDEX_FILE).is_file()

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        files = set(json.loads((path / hf.INDEX_FILE).read_text())["weight_map"].values())
        return {k: v for f in files for k, v in load_file(path / f).items()}

    before, after = tensors(source), tensors(out)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.bfloat16, name
        assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    # transformers reads the exported config back to the same model.
    original, reloaded = (transformers.LlamaForCausalLM.from_pretrained(p).eval() for p in (source, out))
    tokens = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, original(input_ids=tokens).logits, rtol=0, atol=0)


def test_broken_hf_directories_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        hf.HFCheckpoint(tmp_path)
    make_hf_model(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / hf.INDEX_FILE).read_text())
    (tmp_path / "sharded" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(UserError, match=r"shard model-.*safetensors named in model.safetensors.index.json is missing"):
        hf.HFCheckpoint(tmp_path / "sharded")
    make_hf_model(tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported; dtrain imports 'deepseek_v3', .*'llama', "
                                        ".*'mixtral', .*'qwen3' and 'qwen3_moe'"):
        hf.HFCheckpoint(tmp_path / "other")
    # Llama weights under a Mixtral config.json.
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "model_type": "mixtral", "num_local_experts": 4,
                                                                 "num_experts_per_tok": 2}))
    with pytest.raises(UserError, match=r"unexpected tensor model\.layers\.0\.mlp\.\w+_proj\.weight; it is not part of "
                                        r"a Mixtral model"):
        hf.HFCheckpoint(tmp_path / "other")
    make_hf_model(tmp_path / "fewer", num_hidden_layers=2)
    config = json.loads((tmp_path / "fewer" / "config.json").read_text())
    (tmp_path / "fewer" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(UserError, match=r"lacks model.layers.2.input_layernorm.weight \(9 missing"):
        hf.HFCheckpoint(tmp_path / "fewer")
    # A truncated download, of the one file or of a shard; an index that is not one.
    make_hf_model(tmp_path / "cut")
    single = tmp_path / "cut" / hf.SINGLE_FILE
    os.truncate(single, single.stat().st_size - 100)
    with pytest.raises(UserError, match=r"model\.safetensors is not a whole safetensors file \(.*\); re-download"):
        hf.HFCheckpoint(tmp_path / "cut")
    make_hf_model(tmp_path / "cut shard", max_shard_size="20KB")
    shard = tmp_path / "cut shard" / sorted(set(json.loads((tmp_path / "cut shard" / hf.INDEX_FILE).read_text())
                                                ["weight_map"].values()))[0]
    os.truncate(shard, 1000)
    with pytest.raises(UserError, match=rf"{shard.name} is not a whole safetensors file"):
        hf_convert.load_hf_params(tmp_path / "cut shard")
    (tmp_path / "cut shard" / hf.INDEX_FILE).write_text('{"weight_map": ')
    with pytest.raises(UserError, match="model.safetensors.index.json is not a safetensors index"):
        hf.HFCheckpoint(tmp_path / "cut shard")


def make_hf_mixtral(path: Path, *, tie: bool = False, rope: dict | None = None, rope_theta: float = 1e6,
                    dtype=torch.float32, fused: bool = False, max_shard_size: str | None = None,
                    **shape) -> "transformers.MixtralForCausalLM":
    """A random small Mixtral saved with save_pretrained: the hub's per-expert tensors, or with `fused`
    transformers 5's in-memory layout (gate_up_proj). Random norms; a router with larger weights than
    HF's init, so that routing is far from uniform and a wrong expert order changes the output."""
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
              max_position_embeddings=256, tie_word_embeddings=tie, router_aux_loss_coef=0.02)
    kw.update(shape)
    kw["rope_parameters"] = {"rope_theta": kw.pop("rope_theta", rope_theta), **(rope or {"rope_type": "default"})}
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model = model.to(dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra, **({"save_original_format": False} if fused else {}))
    return model


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / hf.INDEX_FILE
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {hf.SINGLE_FILE}
    return {k: v for f in files for k, v in load_file(path / f).items()}


@pytest.mark.parametrize("fused,tie,rope,window", [(False, False, None, None), (True, True, LLAMA3_ROPE, None),
                                                  (False, False, None, 7)],
                         ids=["hub-layout", "fused-layout-tied-llama3-rope", "sliding-window"])
def test_imported_mixtral_gives_transformers_logits_and_loss(tmp_path, fused, tie, rope, window):
    model = make_hf_mixtral(tmp_path, fused=fused, tie=tie, rope=rope, sliding_window=window)
    names = _safetensors(tmp_path).keys()
    assert any("gate_up_proj" in n for n in names) == fused and any(".experts.3.w2." in n for n in names) != fused
    cfg, params = hf_convert.load_hf_params(tmp_path)
    # 2 layers, top-2: transformers' pooled coefficient times k / L is the same per-layer one.
    assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_dim, cfg.aux_loss_coef) == (4, 2, 96, 0.02)
    assert cfg.score_func == "softmax" and cfg.route_norm and cfg.num_shared_experts == 0 and cfg.capacity_factor is None
    assert cfg.tie_embeddings == tie and (cfg.rope_scaling is not None) == (rope is not None)
    assert cfg.sliding_window == window  # 7 of the 40 tokens below: the window changes the logits
    assert params["blocks.1.moe.experts.w_gate"].shape == (4, 96, 64) and params["blocks.1.moe.experts.w_down"].shape == (4, 64, 96)
    _assert_matches_transformers(model, params, cfg, mixtral.forward)


def test_mixtral_round_trip_is_bit_exact_and_exports_the_hub_layout(tmp_path):
    source = tmp_path / "hf"
    make_hf_mixtral(source, dtype=torch.bfloat16, max_shard_size="40KB")
    assert (source / hf.INDEX_FILE).is_file()
    hf_convert.import_hf(source, tmp_path / "run" / "checkpoints" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported", max_shard_bytes=50_000)
    assert (out / hf.INDEX_FILE).is_file()
    # The fused layout of the same model exports to the same per-expert tensors.
    make_hf_mixtral(tmp_path / "fused", dtype=torch.bfloat16, fused=True)
    hf_convert.import_hf(tmp_path / "fused", tmp_path / "run2" / "step_000000")
    out2 = hf_convert.export_hf(tmp_path / "run2", tmp_path / "exported2")
    before = _safetensors(source)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in before
    for after in (_safetensors(out), _safetensors(out2)):
        assert before.keys() == after.keys()
        for name in before:
            assert before[name].dtype == after[name].dtype == torch.bfloat16, name
            assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["router_aux_loss_coef"]) == ("mixtral", 4, 0.02)
    original, reloaded = (transformers.MixtralForCausalLM.from_pretrained(p).eval() for p in (source, out))
    tokens = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, original(input_ids=tokens).logits, rtol=0, atol=0)


def test_mixtral_aux_loss_coefficient_gives_each_router_transformers_balancing_gradient(tmp_path):
    """transformers pools the router statistics of all layers into one loss; dtrain adds one per layer.
    Where every layer's load is the pooled load (here: every layer routes the same logits), the
    converted coefficient gives each layer's router logits transformers' gradient exactly, and the
    unconverted one L / k times it. Import and export convert, and a round trip keeps the value."""
    from dtrain.interop.mixtral import aux_loss_coef_from_hf
    from models import moe
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_layers, tokens, num_experts, top_k, hf_coef = 8, 64, 8, 2, 0.02
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(0))
    hf_logits = [logits.clone().requires_grad_() for _ in range(num_layers)]
    hf_grads = torch.autograd.grad(hf_coef * load_balancing_loss_func(tuple(hf_logits), num_experts, top_k),
                                   hf_logits)

    def dtrain_grads(coef: float) -> list[torch.Tensor]:
        layer_logits = [logits.clone().requires_grad_() for _ in range(num_layers)]
        total = 0.0
        for layer in layer_logits:
            scores = layer.softmax(-1)
            ids = scores.topk(top_k, dim=-1).indices
            routing = moe.Routing(ids, scores.gather(-1, ids), scores, layer)
            total = total + moe.load_balancing_loss(routing, moe.expert_load(routing, num_experts), "softmax")
        return torch.autograd.grad(coef * total, layer_logits)

    converted = aux_loss_coef_from_hf(hf_coef, top_k, num_layers)
    assert converted == hf_coef * top_k / num_layers
    for ours, theirs in zip(dtrain_grads(converted), hf_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
    unconverted = dtrain_grads(hf_coef)
    torch.testing.assert_close(unconverted[0], hf_grads[0] * num_layers / top_k, rtol=1e-6, atol=1e-9)

    make_hf_mixtral(tmp_path / "hf", num_hidden_layers=4, router_aux_loss_coef=0.001)
    cfg, _ = hf_convert.load_hf_params(tmp_path / "hf")
    assert cfg.aux_loss_coef == 0.0005
    hf_convert.import_hf(tmp_path / "hf", tmp_path / "run" / "step_000000")
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported")
    assert json.loads((out / "config.json").read_text())["router_aux_loss_coef"] == 0.001


def test_broken_mixtral_directories_and_unexportable_models_are_one_line_errors(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    make_hf_mixtral(tmp_path / "hf")
    file = tmp_path / "hf" / hf.SINGLE_FILE
    tensors = load_file(file)
    missing = tensors.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"lacks model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight \(1 missing, "
                                        r"0 unexpected tensors\); the checkpoint does not match its config.json") as info:
        hf.HFCheckpoint(tmp_path / "hf")
    assert "\n" not in str(info.value)
    save_file({**tensors, "model.layers.1.block_sparse_moe.experts.2.w3.weight": missing[:, :48].contiguous()}, file)
    with pytest.raises(UserError, match=r"experts\.2\.w3\.weight has shape \[96, 48\] but config.json implies \[96, 64\]: "
                                        r"the size 64 \(config.json's hidden_size\) differs"):
        hf_convert.load_hf_params(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(UserError, match=r"has model\.layers\.0\.block_sparse_moe\.experts\.3\.w1\.weight, which its "
                                        r"config.json does not account for \(0 missing, 6 unexpected"):
        hf.HFCheckpoint(tmp_path / "hf")
    config_path.write_text(json.dumps({**config, "sliding_window": 0}))
    with pytest.raises(UserError, match="sliding_window=0 is not a positive number of tokens"):
        hf.HFCheckpoint(tmp_path / "hf")
    # A Mixtral checkpoint for a Llama run names the fix.
    hf_cfg = hf.config_from_hf(config, "HF")
    with pytest.raises(UserError, match="HF is a Mixtral checkpoint but --model tiny is not; choose a Mixtral"):
        hf.check_matches(hf_cfg, PRESETS["tiny"], "tiny", "HF")
    # Export of an MoE model HF has no equivalent of fails before any tensor is read.
    make_hf_mixtral(tmp_path / "ok")
    checkpoint = hf_convert.import_hf(tmp_path / "ok", tmp_path / "run" / "step_000000")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["model"].update(num_shared_experts=1, score_func="sigmoid")
    ckpt.write_meta(checkpoint, meta)  # with the marker's checksum of the edited meta.json
    capsys.readouterr()  # transformers' progress bars
    assert hf_convert.main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf_convert: error: this MoE model has no Hugging Face equivalent: num_shared_experts=1 "
                          "(Mixtral has no shared experts); score_func='sigmoid'") and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_export_from_no_checkpoint_or_into_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "empty run").mkdir()
    (tmp_path / "a file").write_text("")
    cases = [([str(tmp_path / "empty run"), str(tmp_path / "out")], "is neither a dtrain checkpoint"),
             ([str(tmp_path / "nowhere"), str(tmp_path / "out")], "is neither a dtrain checkpoint"),
             ([str(tmp_path / "empty run"), str(tmp_path / "a file")], "a file is a file; pass a directory")]
    for args, message in cases:
        assert hf_convert.main(["export", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf_convert: error: ") and "\n" not in err and message in err, err
        assert "--resume" not in err  # dtrain.run's flag, not this tool's
    assert not (tmp_path / "out").exists()
