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
from models.errors import UserError
from tests.launch import run_cli, train_scalars
from tests.test_hf_convert import _assert_matches_transformers, _safetensors
from tools import hf_convert

transformers = pytest.importorskip("transformers")

# The shapes of the tiny-qwen3 and tiny-qwen3-moe presets, so that --model takes these weights.
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)
TINY_MOE = {**TINY, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "mlp_only_layers": [0], "norm_topk_prob": True}


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


def _decay_groups(model) -> list[dict]:
    """dtrain's weight-decay groups in transformers' names: matrices decay; norms and the input
    embedding do not."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _train_transformers(model, steps: int) -> tuple[list[float], list[float]]:
    """transformers + torch AdamW on the CLI's batches (bundled data, seq 64, global batch 8 in
    micro-batches of 2), constant lr 1e-3, clipping at 1: losses and gradient norms per step."""
    from dtrain.data import TokenDataset

    dataset = TokenDataset("bundled", None, 64, 2048, 0)
    optimizer = torch.optim.AdamW(_decay_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        # The step's micro-batches in one forward: the same mean over the global batch's tokens.
        batches = dataset.micro_batches(step, 8, 2, 0, 1)
        inputs, labels = (torch.cat(parts) for parts in zip(*batches))
        loss = torch.nn.functional.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("preset,kw", [("tiny-qwen3", TINY), ("tiny-qwen3-moe", {"moe": True, **TINY_MOE})],
                         ids=["qwen3", "qwen3-moe"])
def test_ten_steps_from_an_import_follow_transformers_and_adamw(tmp_path, preset, kw):
    """Losses within 1e-4, gradient norms within 1e-3 and the final weights within 1e-3 (relative,
    per tensor) of transformers trained by torch AdamW on the same batches (no balancing loss: transformers
    adds none without output_router_logits)."""
    model = make_hf_qwen3(tmp_path / "hf", rope_theta=1e6, **kw)
    overrides = ["--model-overrides", "aux_loss_coef=0"] if kw.get("moe") else []
    run = train_scalars(tmp_path / "run", ["--model", preset, *overrides, "--init-from-hf", str(tmp_path / "hf"),
                                           "--warmup-steps", "1", "--decay", "constant", "--checkpoint-every", "10"])
    losses, norms = _train_transformers(model, 10)
    for step, (ours, theirs) in enumerate(zip(run["train/loss"], losses, strict=True), 1):
        assert abs(ours - theirs) <= 1e-4 * theirs, (step, run["train/loss"], losses)
    for step, (ours, theirs) in enumerate(zip(run["train/grad_norm"], norms, strict=True), 1):
        assert abs(ours - theirs) <= 1e-3 * theirs, (step, run["train/grad_norm"], norms)
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported")
    trained = type(model).from_pretrained(out)
    theirs = dict(model.named_parameters())
    for name, ours in trained.named_parameters():
        # Tensor-wise: Adam moves elements whose gradients are rounding noise by up to lr per step
        # in either direction, so element-wise tolerances would test the noise.
        error = (ours - theirs[name].detach()).norm() / theirs[name].detach().norm()
        assert error <= 1e-3 and (ours - theirs[name]).abs().max() <= 1e-3, (name, error.item())


def test_what_qwen3_cannot_hold_is_a_one_line_error(tmp_path, capsys):
    make_hf_qwen3(tmp_path / "hf", moe=True)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    for change, message in (({"mlp_only_layers": [5]}, r"mlp_only_layers=\[5\] must list layers of 0 .. 2"),
                            ({"num_experts": 3}, "num_experts=3 and num_local_experts=4; it needs one"),
                            ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                             "dtrain reads a Qwen3 window only where it covers every layer"),
                            ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes', which must be true or false")):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=message) as info:
            hf.HFCheckpoint(tmp_path / "hf")
        assert "\n" not in str(info.value)
    # A whole-model window is read; the published configs' num_experts alone is too (transformers
    # 5 writes num_local_experts).
    assert "num_experts" not in config and config["num_local_experts"] == 4
    config_path.write_text(json.dumps({**{k: v for k, v in config.items() if k != "num_local_experts"}, "num_experts": 4,
                                       "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}))
    assert (hf.HFCheckpoint(tmp_path / "hf").config.sliding_window, hf.HFCheckpoint(tmp_path / "hf").config.num_experts) == (8, 4)
    # A Qwen3 checkpoint under a Llama preset names the Qwen3 presets.
    make_hf_qwen3(tmp_path / "dense", **TINY)
    result = run_cli(["--model", "tiny", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                      "--init-from-hf", str(tmp_path / "dense")])
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "is a Qwen3 checkpoint but --model tiny is not; choose a Qwen3 preset" in line
    # Export of what Qwen3-MoE cannot hold fails before any tensor is written.
    from dtrain.checkpoint import storage

    checkpoint = hf_convert.import_hf(tmp_path / "dense", tmp_path / "imported" / "step_000000")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["model"].update(layer_pattern="window-full", sliding_window=4)
    storage.write_meta(checkpoint, meta)
    capsys.readouterr()
    assert hf_convert.main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    assert "Qwen3's layers all attend alike" in capsys.readouterr().err and not (tmp_path / "out").exists()
