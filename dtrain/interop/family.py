"""What one Hugging Face model family means to dtrain, and the pieces every family shares: tensor
names as templates, where a dtrain parameter lies in an HF checkpoint (`Piece`), and the config
fields of the Llama-style attention, norms, embedding and head.

A family is one module of `dtrain.interop` that defines `FAMILY`, an `HFFamily`; `dtrain.interop.hf`
finds it there, so adding a family touches one file."""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import attrs
import torch

from models.config import LlamaConfig, MoEConfig, RopeScaling
from models.errors import UserError

# (HF name pattern, dtrain name template); `{i}` is the layer index. What every family shares:
SHARED_NAMES = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attn.wq"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attn.wk"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attn.wv"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attn.wo"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm"),
    ("model.norm.weight", "head.norm"),
    ("lm_head.weight", "head.output"),
]

# The kind of value each config.json key must hold where present: a count (an integer >= 1, or
# >= 0 with "count0"), a number, a flag (JSON true/false) or an object; "?" admits null. A string
# "false" would otherwise tie the embeddings (bool("false") is True) and "32" fail deep in the code.
CONFIG_TYPES = {
    "hidden_size": "count", "num_hidden_layers": "count", "num_attention_heads": "count",
    "num_key_value_heads": "count?", "head_dim": "count?", "vocab_size": "count", "intermediate_size": "count",
    "max_position_embeddings": "count?", "rms_norm_eps": "number", "rope_theta": "number?",
    "tie_word_embeddings": "flag", "attention_bias": "flag", "mlp_bias": "flag", "rope_parameters": "object?",
    "rope_scaling": "object?",
}
_KIND_WORDS = {"count": "a positive integer", "count0": "an integer >= 0", "number": "a number",
               "flag": "true or false", "object": "an object"}


def _is_kind(value: Any, kind: str) -> bool:
    if kind in ("count", "count0"):
        return isinstance(value, int) and not isinstance(value, bool) and value >= (kind == "count")
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, bool if kind == "flag" else dict)


def check_config_types(hf: dict[str, Any], types: dict[str, str], source: str) -> None:
    """Every key of `types` that config.json holds has a value of its kind (CONFIG_TYPES)."""
    for key, kind in types.items():
        if key not in hf or (kind.endswith("?") and hf[key] is None):
            continue
        if not _is_kind(hf[key], kind.rstrip("?")):
            raise UserError(f"{source}: config.json has {key}={hf[key]!r}, which must be "
                            f"{_KIND_WORDS[kind.rstrip('?')]}; compare it with the model's published config.json")


def pattern(template: str) -> re.Pattern:
    """A template with `{i}` (layer) and `{j}` (expert) placeholders as a regular expression."""
    escaped = re.escape(template)
    for key in ("i", "j"):
        escaped = escaped.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
    return re.compile("^" + escaped + "$")


def name_tables(names: list[tuple[str, str]]) -> tuple[list, list]:
    """(HF -> dtrain, dtrain -> HF) lookup tables of a list of (HF, dtrain) templates."""
    return [(pattern(h), d) for h, d in names], [(pattern(d), h) for h, d in names]


def map_name(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for regex, template in table:
        if m := regex.match(name):
            for key, value in m.groupdict().items():
                template = template.replace("{" + key + "}", value)
            return template
    return None


@attrs.frozen
class Piece:
    """Where (part of) a dtrain parameter lies in an HF checkpoint: a whole tensor; expert
    `expert`'s [out, in] matrix of a stacked [E, out, in] parameter; or the first (`half`=0) or
    second half of dim 1 of a fused [E, 2F, D] tensor. `rope_rows` (period, start, width): in every
    `period` rows, rows start .. start + width - 1 are a RoPE projection whose pairs the checkpoint
    interleaves ((x0, x1), (x2, x3) ...) where dtrain's rotate-half RoPE pairs x_j with x_{j+width/2}."""

    hf_name: str
    expert: int | None = None
    half: int | None = None
    rope_rows: tuple[int, int, int] | None = None

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape, for a dtrain parameter of `shape`."""
        if self.expert is not None:
            return tuple(shape[1:])
        if self.half is not None:
            return (shape[0], 2 * shape[1], *shape[2:])
        return tuple(shape)

    def to_dtrain(self, value: torch.Tensor) -> torch.Tensor:
        """The HF tensor in dtrain's row order (the same tensor where the orders agree)."""
        return value if self.rope_rows is None else value[_rope_order(value.shape[0], *self.rope_rows)]

    def to_hf(self, value: torch.Tensor) -> torch.Tensor:
        if self.rope_rows is None:
            return value
        return value[torch.argsort(_rope_order(value.shape[0], *self.rope_rows))]


def _rope_order(rows: int, period: int, start: int, width: int) -> torch.Tensor:
    """Row i of dtrain's order is row order[i] of the interleaved one."""
    within = torch.arange(period)
    within[start:start + width] = start + torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
    return (torch.arange(0, rows, period)[:, None] + within).flatten()


class HFFamily:
    """One HF `model_type`: its config conversion and where each dtrain parameter lies in its
    checkpoints (which may come in several tensor layouts)."""

    model_type: str
    architecture: str
    title: str
    config_cls: type
    # Fields that change neither the parameters nor the forward math, which a run may choose freely.
    free_fields: frozenset[str] = frozenset({"init_std"})
    export_layout = "hub"
    preset_hint = "a Llama preset"  # what a run of another family should choose instead
    config_types: dict[str, str] = {}  # the family's own config.json keys, beside CONFIG_TYPES

    def config_from_hf(self, hf: dict[str, Any], source: str) -> LlamaConfig | MoEConfig:
        raise NotImplementedError

    def describes(self, cfg) -> bool:
        """Whether `cfg` is a model of this family (exactly its config class; families that share
        one class tell their models apart by a field, such as Qwen3's qk_norm)."""
        return type(cfg) is self.config_cls

    def config_to_hf(self, cfg, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        """HF's config.json for `cfg`; a UserError where HF has no equivalent."""
        raise NotImplementedError

    def known(self, hf_name: str) -> bool:
        """Whether a tensor of this name belongs to the family (in any layout)."""
        raise NotImplementedError

    def layout(self, hf_names: Iterable[str], hf_config: dict[str, Any] | None = None) -> str:
        """The tensor layout of a checkpoint holding `hf_names`, with config.json `hf_config`."""
        return "hub"

    def export_layout_of(self, base: dict[str, Any] | None) -> str:
        """The layout an export writes, given the config.json an import came from (or None)."""
        return self.export_layout

    def ignored(self, hf_name: str, cfg) -> bool:
        """Whether a tensor of this name is one a checkpoint may carry that dtrain does not read
        (a copy of a shared weight)."""
        return False

    def with_tensors(self, cfg, hf_names: Iterable[str]):
        """The model config where the tensors present say more than config.json (default: `cfg`)."""
        return cfg

    def pieces(self, name: str, cfg, layout: str) -> list[Piece]:
        """Where dtrain parameter `name` lies in a checkpoint of `layout`."""
        raise NotImplementedError


def common_config_from_hf(hf: dict[str, Any], source: str, title: str, *, default_theta: float,
                          default_eps: float) -> dict[str, Any]:
    """The config fields every family shares (the legacy `rope_theta`/`rope_scaling` keys or the
    newer `rope_parameters`), after checking what dtrain's attention cannot do."""
    unsupported = {key: hf.get(key) for key, ok in (("hidden_act", "silu"), ("attention_bias", False),
                                                    ("mlp_bias", False)) if hf.get(key, ok) != ok}
    if unsupported:
        raise UserError(f"{source}: {unsupported} differ from dtrain's {title} (silu, no biases); "
                        f"this checkpoint cannot be imported")
    heads = hf["num_attention_heads"]
    # Kept only where it says more than hidden_size / num_attention_heads, so that a model of
    # plain heads follows its dim as the presets do.
    head_dim = hf.get("head_dim")
    if head_dim == hf["hidden_size"] // heads and hf["hidden_size"] % heads == 0:
        head_dim = None
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"{source}: rope type {rope_type!r} is not supported; dtrain has the default and "
                        f"'llama3' RoPE scalings")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_seq_len=int(rope["original_max_position_embeddings"]))
    return dict(
        dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, vocab_size=hf["vocab_size"],
        rope_theta=float(rope["rope_theta"]), rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", default_eps)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def common_config_to_hf(cfg: LlamaConfig | MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None,
                        max_positions: int, **fields: Any) -> dict[str, Any]:
    """HF's config.json: the shared fields, RoPE and dtype, plus the family's `fields`; `base`
    (the config an import came from) keeps its other keys."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
        max_positions = int(s.original_max_seq_len * s.factor)
    out = dict(base or {"max_position_embeddings": max_positions})
    out.update(
        hidden_size=cfg.dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", **fields,
    )
    # transformers >= 5 reads `dtype`, older versions `torch_dtype`.
    out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    # Both spellings of RoPE, so that transformers before and after 5.0 read the same model.
    out["rope_parameters"] = rope
    out["rope_theta"] = cfg.rope_theta
    out["rope_scaling"] = None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"}
    return out
