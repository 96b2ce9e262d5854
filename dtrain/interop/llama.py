"""Hugging Face Llama checkpoints (`LlamaForCausalLM`) <-> dtrain's dense model (`models.llama`).
dtrain's RoPE uses HF's rotate-half layout, so q/k projections are copied unpermuted and a round
trip is bit-exact."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.interop.family import SHARED_NAMES, HFFamily, Piece, common_config_from_hf, common_config_to_hf, map_name, name_tables
from models.config import LlamaConfig
from models.errors import UserError

# Llama's dense feed-forward.
NAMES = SHARED_NAMES + [
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.w_gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.w_up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.w_down"),
]
_HF_TO_DTRAIN, _DTRAIN_TO_HF = name_tables(NAMES)


class Llama(HFFamily):
    model_type, architecture, title, config_cls = "llama", "LlamaForCausalLM", "Llama", LlamaConfig

    def describes(self, cfg) -> bool:
        return type(cfg) is LlamaConfig and not cfg.qk_norm  # with qk-norm: Qwen3

    def config_from_hf(self, hf: dict[str, Any], source: str) -> LlamaConfig:
        common = common_config_from_hf(hf, source, self.title, default_theta=10000.0, default_eps=1e-6)
        return LlamaConfig(ffn_dim=hf["intermediate_size"], **common)

    def config_to_hf(self, cfg: LlamaConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        if cfg.sliding_window is not None:
            raise UserError(f"sliding_window={cfg.sliding_window}: Hugging Face's Llama has no sliding window, so "
                            f"the export would attend differently; export a model without one")
        return common_config_to_hf(cfg, dtype, base, 8192, architectures=[self.architecture],
                                   model_type=self.model_type, intermediate_size=cfg.ffn_dim,
                                   attention_bias=False, mlp_bias=False)

    def known(self, hf_name: str) -> bool:
        return map_name(hf_name, _HF_TO_DTRAIN) is not None

    def pieces(self, name: str, cfg: LlamaConfig, layout: str) -> list[Piece]:
        hf_name = map_name(name, _DTRAIN_TO_HF)
        assert hf_name is not None, name
        return [Piece(hf_name)]


FAMILY = Llama()
