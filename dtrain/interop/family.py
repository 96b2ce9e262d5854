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

from models.config import LlamaConfig, MoEConfig, RopeScaling, YarnScaling
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


def layer_indices(hf: dict[str, Any], key: str, layers: int, source: str) -> list[int] | None:
    """config.json's list of layer indices under `key` (None where it has none): each one a layer
    of the model, where transformers would pass over a string or an index past the last layer."""
    listed = hf.get(key)
    if listed is not None and not (isinstance(listed, list) and all(type(i) is int and 0 <= i < layers
                                                                     for i in listed)):
        raise UserError(f"{source}: {key}={listed!r} must list layers of 0 .. {layers - 1}")
    return listed


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
    """Where (part of) a dtrain parameter lies in an HF checkpoint.

    Reading, the HF tensor goes through these steps in order (export undoes them in reverse):
    - `expert`: expert j's [out, in] matrix of a stacked [E, out, in] parameter (one HF tensor per expert);
    - `scales`: the tensor is MXFP4 (`hf_name` its blocks, `scales` its scales' name), dequantized
      to [..., out, in] (read-only: an export writes the unquantized form);
    - `half`: the first (0) or second (1) half of dim `split_dim` of a fused tensor: contiguous, or
      with `interleaved` every second row from `half` on (gpt-oss's gate/up columns);
    - `transposed`: the HF tensor is [..., in, out] (x @ W) where dtrain's is [..., out, in];
    - `rope_rows` (period, start, width): in every `period` rows, rows start .. start + width - 1
      are a RoPE projection whose pairs the checkpoint interleaves ((x0, x1), (x2, x3) ...) where
      dtrain's rotate-half RoPE pairs x_j with x_{j+width/2}."""

    hf_name: str
    expert: int | None = None
    half: int | None = None
    rope_rows: tuple[int, int, int] | None = None
    split_dim: int = 1
    interleaved: bool = False
    transposed: bool = False
    scales: str | None = None

    def hf_names(self) -> tuple[str, ...]:
        """The HF tensors this piece reads."""
        return (self.hf_name,) if self.scales is None else (self.hf_name, self.scales)

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape (the dequantized one for MXFP4), for a dtrain parameter of `shape`."""
        shape = list(shape[1:] if self.expert is not None else shape)
        if self.transposed:
            shape[-1], shape[-2] = shape[-2], shape[-1]
        if self.half is not None:
            shape[self.split_dim] *= 2
        return tuple(shape)

    def to_dtrain(self, value: torch.Tensor) -> torch.Tensor:
        """The whole HF tensor (dequantized) as this piece of the dtrain parameter."""
        if self.half is not None:
            value = value.movedim(self.split_dim, 0)
            rows = value.shape[0] // 2
            value = value[self.half::2] if self.interleaved else value[self.half * rows:(self.half + 1) * rows]
            value = value.movedim(0, self.split_dim)
        if self.transposed:
            value = value.transpose(-1, -2)
        return value if self.rope_rows is None else value[_rope_order(value.shape[0], *self.rope_rows)]

    def to_hf(self, value: torch.Tensor) -> torch.Tensor:
        """This piece of a dtrain parameter in the HF tensor's order (a half's own part of it,
        which `join_halves` puts together with the other half)."""
        if self.rope_rows is not None:
            value = value[torch.argsort(_rope_order(value.shape[0], *self.rope_rows))]
        return value.transpose(-1, -2).contiguous() if self.transposed else value


def join_halves(first: torch.Tensor, second: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The fused HF tensor of its two halves (each as `Piece.to_hf` gives it)."""
    if not piece.interleaved:
        return torch.cat([first, second], dim=piece.split_dim)
    return torch.stack([first, second], dim=piece.split_dim + 1).flatten(piece.split_dim, piece.split_dim + 1)


def _rope_order(rows: int, period: int, start: int, width: int) -> torch.Tensor:
    """Row i of dtrain's order is row order[i] of the interleaved one."""
    within = torch.arange(period)
    within[start:start + width] = start + torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
    return (torch.arange(0, rows, period)[:, None] + within).flatten()


class HFFamily:
    """One HF `model_type`: its config conversion and where each dtrain parameter lies in its
    checkpoints (which may come in several tensor layouts)."""

    model_type: str
    also_reads: tuple[str, ...] = ()  # other model_types whose checkpoints it reads (an export writes model_type)
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
                          default_eps: float, attention_bias: bool = False, yarn: bool = False) -> dict[str, Any]:
    """The config fields every family shares (the legacy `rope_theta`/`rope_scaling` keys or the
    newer `rope_parameters`), after checking what dtrain's attention cannot do; `attention_bias`
    and `yarn`: the family may have attention biases (read as such) and YaRN."""
    checks = [("hidden_act", "silu"), ("mlp_bias", False)] + ([] if attention_bias else [("attention_bias", False)])
    unsupported = {key: hf.get(key) for key, ok in checks if hf.get(key, ok) != ok}
    if unsupported:
        raise UserError(f"{source}: {unsupported} differ from dtrain's {title} (silu, no "
                        f"{'MLP ' if attention_bias else ''}biases); this checkpoint cannot be imported")
    heads = hf["num_attention_heads"]
    # Kept only where it says more than hidden_size / num_attention_heads, so that a model of
    # plain heads follows its dim as the presets do.
    head_dim = hf.get("head_dim")
    if head_dim == hf["hidden_size"] // heads and hf["hidden_size"] % heads == 0:
        head_dim = None
    theta, scaling = rope_from_hf(hf, source, default_theta, yarn)
    fields = dict(
        dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, vocab_size=hf["vocab_size"],
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", default_eps)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if attention_bias:
        fields["attention_bias"] = bool(hf.get("attention_bias", False))
    return fields


def rope_from_hf(hf: dict[str, Any], source: str, default_theta: float,
                 yarn: bool = False) -> tuple[float, RopeScaling | YarnScaling | None]:
    """RoPE's theta and scaling from `rope_parameters` (transformers >= 5) or the legacy
    `rope_theta`/`rope_scaling` keys: the default, llama3's and (where `yarn`) YaRN's."""
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    known = ("default", "llama3", "yarn") if yarn else ("default", "llama3")
    if rope_type not in known:
        raise UserError(f"{source}: rope type {rope_type!r} is not supported; dtrain reads {', '.join(map(repr, known))} "
                        f"RoPE scalings here")
    theta = float(rope["rope_theta"])
    if rope_type == "llama3":
        return theta, RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                  high_freq_factor=float(rope["high_freq_factor"]),
                                  original_max_seq_len=int(rope["original_max_position_embeddings"]))
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None:
            raise UserError(f"{source}: YaRN with an explicit attention_factor={rope['attention_factor']} is not "
                            f"supported; dtrain derives it from factor, mscale and mscale_all_dim")
        return theta, YarnScaling(
            factor=float(rope["factor"]), original_max_seq_len=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            truncate=bool(rope.get("truncate", True)))
    return theta, None


def rope_to_hf(theta: float, scaling: RopeScaling | YarnScaling | None) -> dict[str, Any]:
    """transformers' `rope_parameters` of RoPE with `scaling`."""
    if isinstance(scaling, YarnScaling):
        return {"rope_type": "yarn", "rope_theta": theta, "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_seq_len, "beta_fast": scaling.beta_fast,
                "beta_slow": scaling.beta_slow, "truncate": scaling.truncate,
                **({"mscale": scaling.mscale} if scaling.mscale else {}),
                **({"mscale_all_dim": scaling.mscale_all_dim} if scaling.mscale_all_dim else {})}
    if scaling is not None:
        return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_seq_len}
    return {"rope_type": "default", "rope_theta": theta}


def common_config_to_hf(cfg: LlamaConfig | MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None,
                        max_positions: int, **fields: Any) -> dict[str, Any]:
    """HF's config.json: the shared fields, RoPE and dtype, plus the family's `fields`; `base`
    (the config an import came from) keeps its other keys."""
    rope = rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_scaling is not None:
        max_positions = int(cfg.rope_scaling.original_max_seq_len * cfg.rope_scaling.factor)
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
