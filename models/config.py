"""Model shapes and the named presets."""

from __future__ import annotations

import attrs

from models.errors import UserError


@attrs.frozen
class RopeScaling:
    """Llama-3.1 style frequency scaling of RoPE for long contexts."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@attrs.frozen
class LlamaConfig:
    """A dense Llama-style decoder: GQA attention, RoPE, RMSNorm, SwiGLU."""

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Mistral-style sliding-window attention: each token sees itself and the window - 1 before it.
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_shape(self, ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size"))

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


def _check_shape(cfg, positive: tuple[str, ...]) -> None:
    """The checks every decoder shares: positive sizes, whole heads, whole GQA groups."""
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UserError(f"model {name}={getattr(cfg, name)} must be >= 1")
    if cfg.dim % cfg.num_heads:
        raise UserError(f"model dim={cfg.dim} is not divisible by num_heads={cfg.num_heads}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(
            f"num_heads={cfg.num_heads} is not divisible by num_kv_heads={cfg.num_kv_heads}"
        )
    if cfg.sliding_window is not None and cfg.sliding_window < 1:
        raise UserError(f"sliding_window={cfg.sliding_window} must be >= 1 (tokens each token sees, itself "
                        f"included), or none for full causal attention")


SCORE_FUNCS = ("softmax", "sigmoid")


@attrs.frozen
class MoEConfig:
    """A sparse Mixtral/DeepSeek-style decoder: Llama attention, a routed mixture of SwiGLU experts
    in place of the dense feed-forward (optionally plus always-on shared experts)."""

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    # One SwiGLU of width num_shared_experts * expert_ffn_dim that every token goes through (DeepSeekMoE).
    num_shared_experts: int = 0
    score_func: str = "softmax"
    # Renormalise each token's top-k weights to sum to 1 (Mixtral's softmax over the chosen logits).
    route_norm: bool = True
    # Switch/GShard load-balancing loss num_experts * sum_e f_e * P_e, and the router z-loss.
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    # Auxiliary-loss-free balancing (DeepSeek-V3): per-expert selection bias moved by this much
    # per step towards balance; 0 keeps the bias out of the model.
    bias_update_rate: float = 0.0
    # None: dropless. Else each expert keeps ceil(factor * tokens * top_k / num_experts) tokens.
    capacity_factor: float | None = None
    # Benchmarks only: token t's j-th choice is expert (t * top_k + j) mod num_experts, so every
    # expert gets the same load, as a trained router's near-balance gives. An untrained router on
    # synthetic tokens sends most tokens to a few experts, which under expert parallelism times the
    # imbalance rather than the model (Megatron's --moe-router-force-load-balancing and
    # TorchTitan's _debug_force_load_balance do the same). The weights are still the router's scores.
    force_load_balance: bool = False
    # DeepSeekMoE: the first layers keep a dense SwiGLU of width dense_ffn_dim.
    first_dense_layers: int = 0
    dense_ffn_dim: int = 0
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    sliding_window: int | None = None  # as LlamaConfig's

    def __attrs_post_init__(self) -> None:
        _check_shape(self, ("dim", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
                            "num_experts", "top_k", "expert_ffn_dim"))
        if self.top_k > self.num_experts:
            raise UserError(f"top_k={self.top_k} is more than num_experts={self.num_experts}; "
                            f"choose top_k <= {self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise UserError(f"score_func={self.score_func!r} is unknown; choose one of {', '.join(SCORE_FUNCS)}")
        for name in ("num_shared_experts", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "first_dense_layers"):
            if getattr(self, name) < 0:
                raise UserError(f"model {name}={getattr(self, name)} must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise UserError(f"capacity_factor={self.capacity_factor} must be > 0, or None for dropless routing")
        if self.first_dense_layers >= self.num_layers:
            raise UserError(f"first_dense_layers={self.first_dense_layers} leaves no MoE layer out of "
                            f"num_layers={self.num_layers}; make it < {self.num_layers} or use a dense model")
        if self.first_dense_layers and self.dense_ffn_dim < 1:
            raise UserError(f"first_dense_layers={self.first_dense_layers} needs dense_ffn_dim >= 1 "
                            f"(got {self.dense_ffn_dim})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_dense_layers


_LLAMA3_ROPE = RopeScaling(factor=8.0, original_max_seq_len=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, original_max_seq_len=8192)

PRESETS: dict[str, LlamaConfig | MoEConfig] = {
    # CPU tests: 10 steps take seconds. The vocabulary matches the bundled tokenizer.
    "tiny": LlamaConfig(
        dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=192, vocab_size=2048,
        rope_theta=10000.0,
    ),
    # The benchmark shape of BENCHMARKS.md.
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
    # checked in tests/test_moe.py.
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
}

# Field types the command line can set, and how to read each from text.
_OVERRIDE_PARSERS = {
    "int": int,
    "float": float,
    "bool": lambda text: {"1": True, "true": True, "yes": True, "0": False, "false": False,
                          "no": False}[text.lower()],
    "str": str,
    "float | None": lambda text: None if text.lower() == "none" else float(text),
    "int | None": lambda text: None if text.lower() == "none" else int(text),
}


def get_model_config(name: str, overrides: str = "") -> LlamaConfig | MoEConfig:
    """A preset, with `overrides` such as "num_layers=2,vocab_size=1000" applied to its fields."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}") from None
    changes = {}
    fields = attrs.fields_dict(type(config))
    settable = [n for n, f in fields.items() if f.type in _OVERRIDE_PARSERS]
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        key, _, text = item.partition("=")
        field = fields.get(key.strip())
        if field is None or field.type not in _OVERRIDE_PARSERS:
            raise UserError(f"cannot override {key.strip()!r} of the model; settable: {', '.join(settable)}")
        try:
            changes[key.strip()] = _OVERRIDE_PARSERS[field.type](text.strip())
        except (KeyError, ValueError):
            raise UserError(f"model override {item!r}: {text!r} is not a valid {field.type}") from None
    return attrs.evolve(config, **changes)
