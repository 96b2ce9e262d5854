"""Hugging Face Qwen3 checkpoints (`Qwen3ForCausalLM`) <-> dtrain's dense model with qk-norm.

Qwen3 is Llama's decoder (`models.llama`) with heads of an explicit width (`head_dim`, 128 in
every published size, which makes the queries of 0.6B and 32B wider than hidden_size) and
qk-norm: `self_attn.q_norm` and `k_norm`, [head_dim] RMSNorm weights shared by all heads, applied
to each head's query and key before RoPE. In dtrain that is a LlamaConfig with `qk_norm`. Both
rotate halves in RoPE, so q/k are copied unpermuted and a round trip is bit-exact.

transformers' Qwen3Config defaults head_dim to 128 where config.json leaves it out (not to
hidden_size / heads), and so does the import. Sliding-window attention (`use_sliding_window`,
off in every published checkpoint) is read where it covers every layer and refused otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.interop import llama
from dtrain.interop.family import HFFamily, Piece, common_config_from_hf, common_config_to_hf, map_name, name_tables
from models.config import LlamaConfig
from models.errors import UserError

QK_NORM_NAMES = [
    ("model.layers.{i}.self_attn.q_norm.weight", "blocks.{i}.attn.q_norm"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blocks.{i}.attn.k_norm"),
]
_HF_TO_DTRAIN, _DTRAIN_TO_HF = name_tables(llama.NAMES + QK_NORM_NAMES)
# config.json keys of the Qwen3 families, beside the shared ones.
CONFIG_TYPES = {"use_sliding_window": "flag", "sliding_window": "count?", "max_window_layers": "count0?"}


def sliding_window_from_hf(hf: dict[str, Any], source: str) -> int | None:
    """dtrain's sliding_window: None unless `use_sliding_window`; then the window, which must
    cover every layer (Qwen3 windows the layers from max_window_layers on: all of them at 0)."""
    if not hf.get("use_sliding_window", False):
        return None
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    windowed = ([kind == "sliding_attention" for kind in types] if isinstance(types, list)
                else [i >= hf.get("max_window_layers", 0) for i in range(hf["num_hidden_layers"])])
    if window is None or not all(windowed):
        raise UserError(f"{source}: use_sliding_window with sliding_window={window!r} on {sum(windowed)} of "
                        f"{len(windowed)} layers; dtrain reads a Qwen3 window only where it covers every layer "
                        f"(max_window_layers=0)")
    return window


def attention_to_hf(cfg) -> dict[str, Any]:
    """The config.json keys of Qwen3's attention: the window, on every layer or none."""
    if cfg.layer_pattern:
        raise UserError(f"layer_pattern={cfg.layer_pattern!r}: Qwen3's layers all attend alike (one window or "
                        f"none); export a model without a layer pattern")
    windowed = cfg.sliding_window is not None
    kind = "sliding_attention" if windowed else "full_attention"
    return dict(use_sliding_window=windowed, sliding_window=cfg.sliding_window,
                max_window_layers=0 if windowed else cfg.num_layers, layer_types=[kind] * cfg.num_layers,
                attention_bias=False)


class Qwen3(HFFamily):
    model_type, architecture, title, config_cls = "qwen3", "Qwen3ForCausalLM", "Qwen3", LlamaConfig
    preset_hint = "a Qwen3 preset such as qwen3-8b (or tiny-qwen3 with --model-overrides)"
    config_types = CONFIG_TYPES

    def describes(self, cfg) -> bool:
        return type(cfg) is LlamaConfig and cfg.qk_norm

    def config_from_hf(self, hf: dict[str, Any], source: str) -> LlamaConfig:
        common = common_config_from_hf(hf, source, self.title, default_theta=1e6, default_eps=1e-6)
        return LlamaConfig(ffn_dim=hf["intermediate_size"], qk_norm=True, sliding_window=sliding_window_from_hf(hf, source),
                           **{**common, "head_dim": hf.get("head_dim") or 128})

    def config_to_hf(self, cfg: LlamaConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        return common_config_to_hf(cfg, dtype, base, 40960, architectures=[self.architecture],
                                   model_type=self.model_type, intermediate_size=cfg.ffn_dim, **attention_to_hf(cfg))

    def known(self, hf_name: str) -> bool:
        return map_name(hf_name, _HF_TO_DTRAIN) is not None

    def pieces(self, name: str, cfg: LlamaConfig, layout: str) -> list[Piece]:
        hf_name = map_name(name, _DTRAIN_TO_HF)
        assert hf_name is not None, name
        return [Piece(hf_name)]


FAMILY = Qwen3()
