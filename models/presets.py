"""The named model presets, and how the command line changes their fields (`--model-overrides`)."""

from __future__ import annotations

import attrs

from models.config import DeepSeekConfig, LlamaConfig, MoEConfig, RopeScaling, YarnScaling
from models.errors import UserError
from models.family_configs import GptOssConfig, Llama4Config

_LLAMA3_ROPE = RopeScaling(factor=8.0, original_max_seq_len=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, original_max_seq_len=8192)
# gpt-oss's YaRN (both sizes): 32 times the original 4096 positions, the ramp not rounded to whole dims.
_GPT_OSS_YARN = YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
# Llama-4-Scout's llama3 scaling (low == high: no band between the scaled and the kept frequencies).
_SCOUT_ROPE = RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_seq_len=8192)

PRESETS: dict[str, LlamaConfig | MoEConfig] = {
    # CPU tests: 10 steps take seconds. The vocabulary matches the bundled tokenizer.
    "tiny": LlamaConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=192, vocab_size=2048,
        rope_theta=10000.0,
    ),
    # The benchmark shape llama-1b (tools/shapes.py) against which dtrain and its peers were measured.
    "llama-1b": LlamaConfig(
        dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_dim=8192, vocab_size=128256,
    ),
    "llama3.2-1b": LlamaConfig(
        dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        rope_scaling=_LLAMA32_ROPE, tie_embeddings=True,
    ),
    "llama3.2-3b": LlamaConfig(
        dim=3072, num_layers=28, num_heads=24, num_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        rope_scaling=_LLAMA32_ROPE, tie_embeddings=True,
    ),
    "llama3-8b": LlamaConfig(
        dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336, vocab_size=128256,
    ),
    "llama3-70b": LlamaConfig(
        dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672, vocab_size=128256,
    ),
    "llama3.1-405b": LlamaConfig(
        dim=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_dim=53248,
        vocab_size=128256, rope_scaling=_LLAMA3_ROPE,
    ),
    # Mixture-of-experts shapes. Total / active parameter counts (embeddings included) are
    # checked in tests/unit/test_moe.py.
    # CPU tests: 10 steps take seconds. The vocabulary matches the bundled tokenizer.
    "tiny-moe": MoEConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=2048,
        num_experts=8, top_k=2, expert_ffn_dim=128, rope_theta=10000.0,
    ),
    # The 2-H200 benchmark shape: 6.74B total, 1.91B active. AdamW with fp32 master weights
    # (16 bytes/param) is ~54 GB per GPU split over two, leaving room for activations.
    "mixtral-small": MoEConfig(
        dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, vocab_size=32000,
        num_experts=8, top_k=2, expert_ffn_dim=8192,
    ),
    # Published: 46.7B total, 12.9B active.
    "mixtral-8x7b": MoEConfig(
        dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, vocab_size=32000,
        num_experts=8, top_k=2, expert_ffn_dim=14336,
    ),
    # Published: 141B total, 39B active.
    "mixtral-8x22b": MoEConfig(
        dim=6144, num_layers=56, num_heads=48, num_kv_heads=8, vocab_size=32768,
        num_experts=8, top_k=2, expert_ffn_dim=16384,
    ),
    # DeepSeekMoE 16B (published: 16.4B total, 2.8B active): fine-grained experts, 2 shared
    # experts, a dense first layer, no top-k renormalisation.
    "deepseek-moe-16b": MoEConfig(
        dim=2048, num_layers=28, num_heads=16, num_kv_heads=16, vocab_size=102400,
        num_experts=64, top_k=6, expert_ffn_dim=1408, num_shared_experts=2, route_norm=False,
        aux_loss_coef=0.001, first_dense_layers=1, dense_ffn_dim=10944, rope_theta=10000.0,
        norm_eps=1e-6,
    ),
    # DeepSeek family: Multi-head Latent Attention, fine-grained and shared experts, group-limited
    # routing, multi-token prediction. Parameter counts are checked in tests/unit/test_deepseek.py.
    # CPU tests: every DeepSeek feature at the tiny scale (YaRN included, so that the softmax scale
    # is not the default one); the vocabulary matches the bundled tokenizer.
    "tiny-mla": DeepSeekConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=2048,
        num_experts=8, top_k=2, expert_ffn_dim=32, num_shared_experts=1, score_func="sigmoid",
        num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, aux_loss_coef=0.001,
        bias_update_rate=0.001, first_dense_layers=1, dense_ffn_dim=128,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mtp_depth=1, rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=32, mscale=1.0, mscale_all_dim=1.0),
    ),
    # The 2-H200 benchmark shape (published: 15.7B total, 2.4B active): no query compression,
    # softmax routing without renormalisation, no MTP.
    "deepseek-v2-lite": DeepSeekConfig(
        dim=2048, num_layers=27, num_heads=16, num_kv_heads=16, vocab_size=102400,
        num_experts=64, top_k=6, expert_ffn_dim=1408, num_shared_experts=2, route_norm=False,
        aux_loss_coef=0.001, first_dense_layers=1, dense_ffn_dim=10944,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_scaling=YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=0.707, mscale_all_dim=0.707),
    ),
    # DeepSeek-V3 (published: 671B total, 37B active, plus an MTP module of 11.5B): sigmoid routing
    # over 8 groups (4 per token), auxiliary-loss-free balancing, one MTP module. The YaRN settings
    # are those of the released checkpoint (`--model-overrides rope_scaling=none` for plain RoPE).
    "deepseek-v3": DeepSeekConfig(
        dim=7168, num_layers=61, num_heads=128, num_kv_heads=128, vocab_size=129280,
        num_experts=256, top_k=8, expert_ffn_dim=2048, num_shared_experts=1, score_func="sigmoid",
        num_expert_groups=8, topk_groups=4, routed_scaling_factor=2.5, aux_loss_coef=0.0001,
        bias_update_rate=0.001, first_dense_layers=3, dense_ffn_dim=18432,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mtp_depth=1, rope_scaling=YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0),
    ),
    # Qwen3: Llama's decoder with qk-norm and 128-wide heads in every size (the queries of 0.6B and
    # 32B are wider than dim). CPU tests: the tiny shapes keep queries wider than dim; the
    # vocabulary matches the bundled tokenizer.
    "tiny-qwen3": LlamaConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=192, vocab_size=2048, head_dim=32,
        qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
    ),
    "qwen3-0.6b": LlamaConfig(
        dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=3072, vocab_size=151936, head_dim=128,
        qk_norm=True, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True,
    ),
    "qwen3-8b": LlamaConfig(
        dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=12288, vocab_size=151936, head_dim=128,
        qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
    ),
    "qwen3-32b": LlamaConfig(
        dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, ffn_dim=25600, vocab_size=151936, head_dim=128,
        qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
    ),
    # Qwen3-MoE: softmax over 128 experts, top-8 renormalised (norm_topk_prob), no shared expert;
    # dense_ffn_dim is the checkpoints' intermediate_size, the width of any mlp_only_layers. The
    # balancing coefficient is the published 0.001 per pooled loss, as one per layer: x top_k / layers.
    # The tiny one keeps a dense first block (mlp_only_layers=[0]), so that tests cover both kinds.
    "tiny-qwen3-moe": MoEConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=2048, head_dim=32, qk_norm=True,
        num_experts=8, top_k=2, expert_ffn_dim=32, dense_ffn_dim=128, dense_layers=(0,), aux_loss_coef=0.001 * 2 / 4,
        rope_theta=1e6, norm_eps=1e-6,
    ),
    "qwen3-30b-a3b": MoEConfig(
        dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, vocab_size=151936, head_dim=128, qk_norm=True,
        num_experts=128, top_k=8, expert_ffn_dim=768, dense_ffn_dim=6144, aux_loss_coef=0.001 * 8 / 48,
        rope_theta=1e6, norm_eps=1e-6,
    ),
    "qwen3-235b-a22b": MoEConfig(
        dim=4096, num_layers=94, num_heads=64, num_kv_heads=4, vocab_size=151936, head_dim=128, qk_norm=True,
        num_experts=128, top_k=8, expert_ffn_dim=1536, dense_ffn_dim=12288, aux_loss_coef=0.001 * 8 / 94,
        rope_theta=1e6, norm_eps=1e-6,
    ),
    # gpt-oss: attention sinks and biases, windows of 128 on even layers, biased experts with the
    # clamped SwiGLU. CPU tests: every part at the tiny scale (heads twice dim wide, a window of 16),
    # the vocabulary the bundled tokenizer's, gpt-oss's YaRN. Parameter counts in tests/unit/test_family_presets.py.
    "tiny-gpt-oss": GptOssConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=2048,
        num_experts=8, top_k=2, expert_ffn_dim=64, aux_loss_coef=0.001, layer_pattern="window-full",
        sliding_window=16, rope_theta=150000.0, rope_scaling=_GPT_OSS_YARN,
    ),
    "gpt-oss-20b": GptOssConfig(
        dim=2880, num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, vocab_size=201088,
        num_experts=32, top_k=4, expert_ffn_dim=2880, aux_loss_coef=0.001, layer_pattern="window-full",
        sliding_window=128, rope_theta=150000.0, rope_scaling=_GPT_OSS_YARN,
    ),
    "gpt-oss-120b": GptOssConfig(
        dim=2880, num_layers=36, num_heads=64, num_kv_heads=8, head_dim=64, vocab_size=201088,
        num_experts=128, top_k=4, expert_ffn_dim=2880, aux_loss_coef=0.001, layer_pattern="window-full",
        sliding_window=128, rope_theta=150000.0, rope_scaling=_GPT_OSS_YARN,
    ),
    # Llama 4 (text): chunked attention on RoPE layers, every fourth layer NoPE, sigmoid top-1
    # experts beside a shared one. CPU tests: chunks of 16, the temperature from position 31 on,
    # Scout's RoPE scaling, the bundled tokenizer's vocabulary. Counts in tests/unit/test_family_presets.py.
    # Dense and MoE blocks alternating (Maverick's), with Scout's qk-norm.
    "tiny-llama4": Llama4Config(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=2048, num_experts=4,
        expert_ffn_dim=64, dense_ffn_dim=128, moe_layer_step=2, attention_chunk=16, floor_scale=32,
        rope_theta=500000.0, rope_scaling=_SCOUT_ROPE,
    ),
    # Every block MoE.
    "llama4-scout-17b-16e": Llama4Config(
        dim=5120, num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128, vocab_size=202048,
        num_experts=16, expert_ffn_dim=8192, dense_ffn_dim=16384, rope_theta=500000.0, rope_scaling=_SCOUT_ROPE,
    ),
    # MoE on every second block, no qk-norm, plain RoPE.
    "llama4-maverick-17b-128e": Llama4Config(
        dim=5120, num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128, vocab_size=202048,
        num_experts=128, expert_ffn_dim=8192, dense_ffn_dim=16384, moe_layer_step=2, qk_l2_norm=False,
        rope_theta=500000.0,
    ),
}

# Field types the command line can set, and how to read each from text.
_OVERRIDE_PARSERS = {
    "int": int,
    "float": float,
    "bool": lambda text: {"1": True, "true": True, "yes": True, "0": False, "false": False,
                          "no": False}[text.lower()],
    "str": str,
    "float | None": lambda text: None if text.lower() == "none" else float(text),
    # Only switched off from the command line: the presets say how to scale.
    "YarnScaling | None": lambda text: {"none": None}[text.lower()],
    "RopeScaling | None": lambda text: {"none": None}[text.lower()],
    "int | None": lambda text: None if text.lower() == "none" else int(text),
    # A list of blocks, bracketed: dense_layers=[0,5] (or [] for none).
    "tuple[int, ...]": lambda text: _int_list(text),
}


def _int_list(text: str) -> tuple[int, ...]:
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError(text)
    return tuple(int(item) for item in text[1:-1].split(",") if item.strip())


def _split_overrides(overrides: str) -> list[str]:
    """"a=1,b=[2,3]" -> ["a=1", "b=[2,3]"]: commas inside brackets belong to a list value."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(overrides):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(overrides[start:index])
            start = index + 1
    return [item.strip() for item in [*items, overrides[start:]] if item.strip()]


def get_model_config(name: str, overrides: str = "") -> LlamaConfig | MoEConfig | DeepSeekConfig:
    """A preset, with `overrides` such as "num_layers=2,vocab_size=1000" applied to its fields."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}") from None
    changes = {}
    # By the names the constructor takes (`head_dim` for the stored explicit_head_dim).
    fields = {f.alias: f for f in attrs.fields(type(config))}
    settable = [n for n, f in fields.items() if f.type in _OVERRIDE_PARSERS]
    for item in _split_overrides(overrides):
        key, _, text = item.partition("=")
        field = fields.get(key.strip())
        if field is None or field.type not in _OVERRIDE_PARSERS:
            raise UserError(f"cannot override {key.strip()!r} of the model; settable: {', '.join(settable)}")
        try:
            changes[key.strip()] = _OVERRIDE_PARSERS[field.type](text.strip())
        except (KeyError, ValueError):
            raise UserError(f"model override {item!r}: {text!r} is not a valid {field.type}") from None
    return attrs.evolve(config, **changes)
