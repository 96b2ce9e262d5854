"""Qwen3 and Qwen3-MoE as configurations of the Llama and MoE decoders: the published sizes'
parameter counts, FLOPs per token by hand, qk-norm's weights and where the plan puts them, and
every shape field of the tiny presets settable from the command line."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from models import flops, llama, mixtral, spec
from models.context import LocalContext
from models.layers import apply_rope, rms_norm, rope_frequencies, rope_table
from models.presets import get_model_config
from parallel.mesh import MeshSpec
from parallel.plan import Plan


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-0.6b", 0.596, 0.596), ("qwen3-8b", 8.19, 8.19), ("qwen3-32b", 32.76, 32.76),
    ("qwen3-30b-a3b", 30.53, 3.35), ("qwen3-235b-a22b", 235.09, 22.19),
])
def test_published_sizes_have_their_parameter_counts(name, total, active):
    """The model cards' 0.6B, 8.2B, 32.8B; 30.5B with 3.3B active; 235B with 22B active."""
    cfg = get_model_config(name)
    counted = spec.count_params(mixtral.layers(cfg) if hasattr(cfg, "num_experts") else llama.layers(cfg))
    assert round(counted / 1e9, 2 if total > 1 else 3) == total
    assert round(flops.active_params(cfg) / 1e9, 2 if total > 1 else 3) == active


def test_flops_per_token_count_the_active_matmuls_and_the_heads_width():
    """6 N + 6 S (qk + v) per layer, with N the matmul weights but the input embedding (the tied
    output head counts) and of the experts the top_k a token runs; qk = v = heads x head_dim,
    which for Qwen3-0.6B (16 x 128) is twice its dim."""
    seq = 4096
    small = get_model_config("qwen3-0.6b")
    d, layers, q, kv, ffn, vocab = 1024, 28, 16 * 128, 8 * 128, 3072, 151936  # head_dim 128
    matmuls = layers * (d * q + 2 * d * kv + q * d + 3 * d * ffn) + vocab * d
    assert flops.matmul_params(small) == matmuls
    assert flops.flops_per_token(small, seq) == 6 * matmuls + 6 * seq * 2 * q * layers
    moe = get_model_config("qwen3-30b-a3b")
    d, layers, q, kv, experts, k, f = 2048, 48, 32 * 128, 4 * 128, 128, 8, 768
    matmuls = layers * (d * q + 2 * d * kv + q * d + experts * d + k * 3 * d * f) + 151936 * d
    assert flops.matmul_params(moe) == matmuls
    assert flops.flops_per_token(moe, seq) == 6 * matmuls + 6 * seq * 2 * q * layers


def test_qk_norm_normalises_each_head_before_rope_with_weights_all_heads_share():
    cfg = get_model_config("tiny-qwen3")
    block = dict(spec.flatten(llama.layers(cfg)[1].params))
    assert block["attn.q_norm"].shape == block["attn.k_norm"].shape == (32,)
    assert block["attn.q_norm"].axes == ("head_dim",) and not block["attn.q_norm"].weight_decay
    # Under tp the heads split and the per-head vector stays whole (its gradient is summed over tp).
    plan = Plan.build(MeshSpec.parse("tp=2", 2))
    assert plan.param_placements(block["attn.q_norm"].axes) == (Replicate(),)
    assert plan.param_placements(block["attn.wq"].axes) == (Shard(0),)
    # The attention sub-block by hand: q/k normed per head, then rotated.
    generator = torch.Generator().manual_seed(0)
    p = {name.removeprefix("attn."): torch.randn(s.shape, generator=generator) * (0.3 if s.init == "ones" else 0.1) + (
        1.0 if s.init == "ones" else 0.0) for name, s in block.items() if name.startswith("attn.")}
    x = torch.randn(2, 8, cfg.dim, generator=generator)
    rope = rope_table(torch.arange(8), rope_frequencies(cfg.head_dim, cfg.rope_theta, None))
    from models.layers import attention_block

    got = attention_block(p, x, rope, cfg.num_heads, cfg.num_kv_heads, LocalContext(), norm_eps=cfg.norm_eps)
    q = apply_rope(rms_norm((x @ p["wq"].T).view(2, 8, 4, 32), p["q_norm"], 1e-6), *rope).transpose(1, 2)
    k = apply_rope(rms_norm((x @ p["wk"].T).view(2, 8, 2, 32), p["k_norm"], 1e-6), *rope).transpose(1, 2)
    v = (x @ p["wv"].T).view(2, 8, 2, 32).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    torch.testing.assert_close(got, out.transpose(1, 2).reshape(2, 8, 128) @ p["wo"].T, rtol=1e-5, atol=1e-6)
    without = {k: v for k, v in p.items() if not k.endswith("_norm")}
    assert not torch.allclose(got, attention_block(without, x, rope, 4, 2, LocalContext()))


SHAPES = {
    "tiny-qwen3": "dim=32,num_layers=3,num_heads=2,num_kv_heads=1,ffn_dim=48,vocab_size=97,head_dim=16,"
                  "rope_theta=5000,norm_eps=1e-5,tie_embeddings=true,sliding_window=8,qk_norm=true",
    "tiny-qwen3-moe": "dim=32,num_layers=3,num_heads=2,num_kv_heads=1,vocab_size=97,head_dim=16,rope_theta=5000,"
                      "norm_eps=1e-5,num_experts=4,top_k=1,expert_ffn_dim=24,dense_ffn_dim=40,moe_layer_step=2,"
                      "dense_layers=[],route_norm=false,aux_loss_coef=0.01,sliding_window=8",
}


@pytest.mark.parametrize("name", SHAPES)
def test_every_shape_field_of_the_tiny_presets_is_settable(name):
    from models.presets import _split_overrides

    cfg = get_model_config(name, SHAPES[name])
    for item in _split_overrides(SHAPES[name]):
        key, text = item.split("=")
        value = getattr(cfg, key)
        expected = {"true": True, "false": False, "[]": ()}.get(text, text)
        assert value == (type(value)(expected) if isinstance(expected, str) else expected), (key, value)
    layers = mixtral.layers(cfg) if hasattr(cfg, "num_experts") else llama.layers(cfg)
    assert dict(spec.flatten(layers[1].params))["attn.wq"].shape == (32, 32)
    if hasattr(cfg, "num_experts"):
        assert cfg.moe_layers == (1,)


def test_tiny_qwen3_moe_forward_routes_its_moe_blocks_and_keeps_the_dense_one():
    from models import moe

    cfg = get_model_config("tiny-qwen3-moe")
    assert cfg.moe_layers == (1, 2, 3) and cfg.route_norm and cfg.qk_norm
    params = spec.unflatten({f"{layer.name}.{path}": spec.init_value(s, 0, f"{layer.name}.{path}").requires_grad_()
                             for layer in mixtral.layers(cfg) for path, s in spec.flatten(layer.params)})
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    stats = moe.RouterStats()
    loss = mixtral.forward(params, tokens, tokens, cfg, LocalContext(), stats)
    loss.backward()
    assert sorted(stats.load) == [1, 2, 3] and "mlp" in params["blocks"]["0"]
    for path, value in spec.flatten(params):
        assert value.grad is not None and value.grad.abs().sum() > 0, path
    assert attrs.evolve(cfg, dense_layers=()).moe_layers == (0, 1, 2, 3)
