"""Hugging Face gpt-oss checkpoints (`GptOssForCausalLM`) <-> dtrain's gpt-oss (`models.gpt_oss`).

Names are Llama's plus the attention's biases and sinks (`self_attn.{q,k,v,o}_proj.bias`,
`self_attn.sinks`), the biased router (`mlp.router.weight`, `.bias`) and the fused experts:
`mlp.experts.gate_up_proj` [E, D, 2F] (x @ W: dtrain's w_gate and w_up transposed, their columns
interleaved, gate the even ones), `gate_up_proj_bias` [E, 2F] likewise, `down_proj` [E, F, D],
`down_proj_bias` [E, D]. `layer_types` (sliding_attention / full_attention) is dtrain's
layer_pattern of window and full layers; YaRN's correction range is not rounded (truncate false).

The published checkpoints store the experts in MXFP4 (`gate_up_proj_blocks` / `_scales`,
`down_proj_blocks` / `_scales`, dtrain/interop/mxfp4.py): they are dequantized to bf16 on import,
and an export writes the fused bf16 tensors above, without `quantization_config`. The
load-balancing coefficient converts as Mixtral's (transformers pools the layers' statistics).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable

import torch

from dtrain.interop.family import (
    SHARED_NAMES, HFFamily, Piece, common_config_from_hf, common_config_to_hf, map_name, name_tables, pattern,
)
from dtrain.interop.mixtral import aux_loss_coef_from_hf, aux_loss_coef_to_hf
from models.errors import UserError
from models.family_configs import GptOssConfig

logger = logging.getLogger("dtrain")

NAMES = SHARED_NAMES + [
    *((f"model.layers.{{i}}.self_attn.{hf}_proj.bias", f"blocks.{{i}}.attn.b{d}") for hf, d in
      (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"))),
    ("model.layers.{i}.self_attn.sinks", "blocks.{i}.attn.sinks"),
    ("model.layers.{i}.mlp.router.weight", "blocks.{i}.moe.router"),
    ("model.layers.{i}.mlp.router.bias", "blocks.{i}.moe.router_logit_bias"),
    ("model.layers.{i}.mlp.experts.down_proj_bias", "blocks.{i}.moe.experts.b_down"),
]
GATE_UP, DOWN = "model.layers.{i}.mlp.experts.gate_up_proj", "model.layers.{i}.mlp.experts.down_proj"
_HF_TO_DTRAIN, _DTRAIN_TO_HF = name_tables(NAMES)
_EXPERT_PATTERNS = [pattern(t + suffix) for t in (GATE_UP, DOWN) for suffix in ("", "_blocks", "_scales")]
_EXPERT_PATTERNS.append(pattern(GATE_UP + "_bias"))
_EXPERTS = re.compile(r"^blocks\.(?P<i>\d+)\.moe\.experts\.(?P<what>w_gate|w_up|w_down|b_gate|b_up)$")
_KINDS = {"sliding_attention": "window", "full_attention": "full"}
MXFP4 = "mxfp4"


def pattern_of(kinds: list[str]) -> str:
    """The shortest layer_pattern that repeats to `kinds`."""
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return "-".join(kinds[:period])


class GptOss(HFFamily):
    model_type, architecture, title, config_cls = "gpt_oss", "GptOssForCausalLM", "gpt-oss", GptOssConfig
    preset_hint = "a gpt-oss preset such as gpt-oss-20b (or tiny-gpt-oss with --model-overrides)"
    free_fields = frozenset({"init_std", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"})
    export_layout = "fused"
    config_types = {"num_local_experts": "count?", "num_experts": "count?", "num_experts_per_tok": "count",
                    "sliding_window": "count?", "swiglu_limit": "number?", "swiglu_alpha": "number?",
                    "router_aux_loss_coef": "number?"}

    def config_from_hf(self, hf: dict[str, Any], source: str) -> GptOssConfig:
        quantization = (hf.get("quantization_config") or {}).get("quant_method")
        if quantization not in (None, MXFP4):
            raise UserError(f"{source}: the weights are {quantization}-quantized; dtrain reads gpt-oss in bf16, fp32 "
                            f"or its published MXFP4 experts: convert the checkpoint to bf16 first")
        common = common_config_from_hf(hf, source, self.title, default_theta=150000.0, default_eps=1e-5,
                                       attention_bias=True, yarn=True)
        layers = common["num_layers"]
        layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(layers)]
        unknown = [kind for kind in layer_types if kind not in _KINDS]
        if unknown or len(layer_types) != layers:
            raise UserError(f"{source}: layer_types {layer_types} must give each of the {layers} layers "
                            f"sliding_attention or full_attention")
        kinds = [_KINDS[kind] for kind in layer_types]
        window = hf.get("sliding_window") if "window" in kinds else None
        if "window" in kinds and window is None:
            raise UserError(f"{source}: sliding_attention layers need sliding_window (the tokens each token sees)")
        top_k = hf["num_experts_per_tok"]
        return GptOssConfig(
            num_experts=hf.get("num_local_experts") or hf["num_experts"], top_k=top_k,
            expert_ffn_dim=hf["intermediate_size"], swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            aux_loss_coef=aux_loss_coef_from_hf(float(hf.get("router_aux_loss_coef", 0.001)), top_k, layers),
            layer_pattern=pattern_of(kinds), sliding_window=window, **common,
        )

    def config_to_hf(self, cfg: GptOssConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        kinds = cfg.layer_kinds
        problems = [what for bad, what in (
            (not cfg.attention_sinks, "attention_sinks=False (every gpt-oss layer has sinks)"),
            (not (cfg.expert_bias and cfg.router_logit_bias), "expert_bias or router_logit_bias false (gpt-oss's "
                                                               "experts and router are biased)"),
            (len(cfg.moe_layers) < cfg.num_layers, f"dense blocks {sorted(set(range(cfg.num_layers)) - set(cfg.moe_layers))} "
                                                    f"(every gpt-oss block is MoE)"),
            (cfg.num_shared_experts, f"num_shared_experts={cfg.num_shared_experts} (gpt-oss has none)"),
            (cfg.num_expert_groups > 1, f"num_expert_groups={cfg.num_expert_groups} (gpt-oss routes over all experts)"),
            (cfg.routed_scaling_factor != 1, f"routed_scaling_factor={cfg.routed_scaling_factor} (gpt-oss has none)"),
            (cfg.bias_update_rate, f"bias_update_rate={cfg.bias_update_rate} (gpt-oss has no selection bias)"),
            (cfg.scale_expert_inputs, "scale_expert_inputs=True (gpt-oss weights the experts' outputs)"),
            (not set(kinds) <= {"window", "full"}, f"layer_pattern={cfg.layer_pattern!r} (gpt-oss has window and "
                                                   f"full layers only)"),
        ) if bad]
        if problems:
            raise UserError(f"this model has no Hugging Face gpt-oss equivalent: {'; '.join(problems)}")
        base = {k: v for k, v in (base or {}).items() if k != "quantization_config"}  # written unquantized
        types = {"window": "sliding_attention", "full": "full_attention"}
        return common_config_to_hf(
            cfg, dtype, base or None, 131072, architectures=[self.architecture], model_type=self.model_type,
            attention_bias=cfg.attention_bias, intermediate_size=cfg.expert_ffn_dim, num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k, sliding_window=cfg.sliding_window or 128,
            layer_types=[types[kind] for kind in kinds], swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
            router_aux_loss_coef=aux_loss_coef_to_hf(cfg.aux_loss_coef, cfg.top_k, cfg.num_layers),
        )

    def known(self, hf_name: str) -> bool:
        return map_name(hf_name, _HF_TO_DTRAIN) is not None or any(p.match(hf_name) for p in _EXPERT_PATTERNS)

    def layout(self, hf_names: Iterable[str], hf_config: dict[str, Any] | None = None) -> str:
        """MXFP4 experts where the checkpoint holds their blocks, else fused bf16 ones."""
        if any(name.endswith("_blocks") for name in hf_names):
            logger.info("gpt-oss checkpoint: its experts are MXFP4; they are dequantized to bfloat16 on import")
            return MXFP4
        return "fused"

    def pieces(self, name: str, cfg: GptOssConfig, layout: str) -> list[Piece]:
        m = _EXPERTS.match(name)
        if m is None:
            hf_name = map_name(name, _DTRAIN_TO_HF)
            assert hf_name is not None, name
            return [Piece(hf_name)]
        gate_up, down = (t.replace("{i}", m.group("i")) for t in (GATE_UP, DOWN))
        what = m.group("what")
        if what in ("b_gate", "b_up"):  # [E, 2F], gate and up interleaved
            return [Piece(gate_up + "_bias", half=("b_gate", "b_up").index(what), interleaved=True)]
        if layout == MXFP4:  # dequantized to [E, out, in]: dtrain's layout, gate and up rows interleaved
            if what == "w_down":
                return [Piece(down + "_blocks", scales=down + "_scales")]
            return [Piece(gate_up + "_blocks", scales=gate_up + "_scales", half=("w_gate", "w_up").index(what),
                          interleaved=True)]
        if what == "w_down":
            return [Piece(down, transposed=True)]
        return [Piece(gate_up, half=("w_gate", "w_up").index(what), split_dim=2, interleaved=True, transposed=True)]


FAMILY = GptOss()
