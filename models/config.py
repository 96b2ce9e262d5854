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

    def __attrs_post_init__(self) -> None:
        for name in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise UserError(f"model {name}={getattr(self, name)} must be >= 1")
        if self.dim % self.num_heads:
            raise UserError(f"model dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


_LLAMA3_ROPE = RopeScaling(factor=8.0, original_max_seq_len=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, original_max_seq_len=8192)

PRESETS: dict[str, LlamaConfig] = {
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
}


def get_model_config(name: str, overrides: str = "") -> LlamaConfig:
    """A preset, with `overrides` such as "num_layers=2,vocab_size=1000" applied to its fields."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}") from None
    changes = {}
    fields = attrs.fields_dict(LlamaConfig)
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        key, _, text = item.partition("=")
        field = fields.get(key.strip())
        if field is None or field.type not in ("int", "float", "bool", int, float, bool):
            settable = [n for n, f in fields.items() if f.type in ("int", "float", "bool", int, float, bool)]
            raise UserError(f"cannot override {key.strip()!r} of the model; settable: {', '.join(settable)}")
        kind = {"int": int, "float": float, "bool": lambda t: t.lower() in ("1", "true", "yes")}.get(field.type, field.type)
        try:
            changes[key.strip()] = kind(text)
        except ValueError:
            raise UserError(f"model override {item!r}: {text!r} is not a valid {field.type}") from None
    return attrs.evolve(config, **changes)
