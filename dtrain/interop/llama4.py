"""Hugging Face Llama 4 checkpoints <-> dtrain's Llama 4 text model (`models.llama4`).

Two layouts are read: `Llama4ForCausalLM` (model_type `llama4_text`, Llama's names) and the
published `Llama4ForConditionalGeneration` (model_type `llama4`): the text model's config in
`text_config` and its tensors under `language_model.` (`language_model.model.layers...`,
`language_model.lm_head.weight`); the vision tower and its projector (`vision_model.*`,
`multi_modal_projector.*`) are left out. An export writes the text model, `Llama4ForCausalLM`.

Per block: `feed_forward.router.weight` [E, D]; the experts fused, `feed_forward.experts.gate_up_proj`
[E, D, 2F] (x @ W: dtrain's w_gate then w_up, transposed) and `down_proj` [E, F, D]; the shared
expert `feed_forward.shared_expert.{gate,up,down}_proj.weight`; dense blocks
`feed_forward.{gate,up,down}_proj.weight`. Llama 4 rotates adjacent pairs of q and k (complex RoPE),
dtrain halves: the q/k projection rows of every head are reordered on import and back on export
(on NoPE layers too, where q.k does not change under it).

The layer kinds: `no_rope_layers` (1: RoPE) and `layer_types` (chunked_attention / full_attention)
give dtrain's layer_pattern (chunk, full, nope); `moe_layers` or `interleave_moe_layer_step`
its moe_layer_step and dense_layers. Llama4ForCausalLM adds no load-balancing loss (aux_loss_coef 0).
The "-FP8" repositories (fbgemm FP8) are refused: convert them to bf16 first.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from dtrain.interop.family import (
    CONFIG_TYPES, SHARED_NAMES, HFFamily, Piece, check_config_types, common_config_from_hf, common_config_to_hf,
    layer_indices, map_name, name_tables,
)
from dtrain.interop.gpt_oss import pattern_of
from models.errors import UserError
from models.family_configs import Llama4Config

NAMES = SHARED_NAMES + [
    *((f"model.layers.{{i}}.self_attn.{hf}_proj.bias", f"blocks.{{i}}.attn.b{d}") for hf, d in
      (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"))),
    ("model.layers.{i}.feed_forward.router.weight", "blocks.{i}.moe.router"),
    *((f"model.layers.{{i}}.feed_forward.shared_expert.{hf}_proj.weight", f"blocks.{{i}}.moe.shared.w_{d}")
      for hf, d in (("gate", "gate"), ("up", "up"), ("down", "down"))),
    *((f"model.layers.{{i}}.feed_forward.{hf}_proj.weight", f"blocks.{{i}}.mlp.w_{d}")
      for hf, d in (("gate", "gate"), ("up", "up"), ("down", "down"))),
    ("model.layers.{i}.feed_forward.experts.gate_up_proj", "blocks.{i}.moe.experts.w_gate"),
    ("model.layers.{i}.feed_forward.experts.down_proj", "blocks.{i}.moe.experts.w_down"),
]
_HF_TO_DTRAIN, _DTRAIN_TO_HF = name_tables(NAMES)
PREFIX = "language_model."
# The published file's other towers, which a text model does not read.
_OTHER_TOWERS = ("vision_model.", "multi_modal_projector.")
_EXPERTS = re.compile(r"^blocks\.(?P<i>\d+)\.moe\.experts\.(?P<what>w_gate|w_up|w_down)$")
_ROPE_PROJECTIONS = re.compile(r"^blocks\.\d+\.attn\.(wq|wk|bq|bk)$")
PUBLISHED, TEXT = "published", "text"


class Llama4(HFFamily):
    model_type, architecture, title, config_cls = "llama4_text", "Llama4ForCausalLM", "Llama 4", Llama4Config
    also_reads = ("llama4",)  # Llama4ForConditionalGeneration, as Meta publishes it
    preset_hint = "a Llama 4 preset such as llama4-scout-17b-16e (or tiny-llama4 with --model-overrides)"
    free_fields = frozenset({"init_std", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"})
    export_layout = TEXT
    config_types = {"num_local_experts": "count", "num_experts_per_tok": "count", "intermediate_size_mlp": "count?",
                    "interleave_moe_layer_step": "count?", "no_rope_layer_interval": "count?",
                    "attention_chunk_size": "count?", "floor_scale": "count?", "attn_scale": "number?",
                    "use_qk_norm": "flag", "text_config": "object?"}

    def config_from_hf(self, hf: dict[str, Any], source: str) -> Llama4Config:
        quantization = (hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
                        or {}).get("quant_method")
        if quantization:
            raise UserError(f"{source}: the weights are {quantization}-quantized (the Llama 4 \"-FP8\" repositories "
                            f"are fbgemm FP8); import the bf16 checkpoint, or convert this one to bf16 first")
        if hf.get("model_type") == "llama4":
            text = hf.get("text_config")
            if not isinstance(text, dict):
                raise UserError(f"{source}: a Llama4ForConditionalGeneration config.json needs text_config, the "
                                f"text model's settings")
            check_config_types(text, {**CONFIG_TYPES, **self.config_types}, source)
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **text}
        common = common_config_from_hf(hf, source, self.title, default_theta=500000.0, default_eps=1e-5,
                                       attention_bias=True)
        layers = common["num_layers"]
        kinds = _layer_kinds(hf, layers, source)
        step, dense = _moe_rule(hf, layers, source)
        return Llama4Config(
            num_experts=hf["num_local_experts"], top_k=hf.get("num_experts_per_tok", 1),
            expert_ffn_dim=hf["intermediate_size"], dense_ffn_dim=hf.get("intermediate_size_mlp", 16384),
            moe_layer_step=step, dense_layers=dense, layer_pattern=pattern_of(kinds),
            attention_chunk=hf.get("attention_chunk_size") if "chunk" in kinds else None,
            qk_l2_norm=bool(hf.get("use_qk_norm", True)),
            # The published file may carry an integer here: read it as true or false.
            attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
            floor_scale=int(hf.get("floor_scale", 8192)), attn_scale=float(hf.get("attn_scale", 0.1)), **common,
        )

    def config_to_hf(self, cfg: Llama4Config, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        kinds = cfg.layer_kinds
        problems = [what for bad, what in (
            ("window" in kinds, f"layer_pattern={cfg.layer_pattern!r} (Llama 4 has no sliding window)"),
            (cfg.first_dense_layers, f"first_dense_layers={cfg.first_dense_layers} (Llama 4 lists its MoE layers)"),
            (cfg.num_expert_groups > 1, f"num_expert_groups={cfg.num_expert_groups} (Llama 4 routes over all experts)"),
            (cfg.score_func != "sigmoid" or cfg.route_norm or not cfg.scale_expert_inputs,
             "routing other than the sigmoid score scaling the expert's input"),
            (cfg.routed_scaling_factor != 1, f"routed_scaling_factor={cfg.routed_scaling_factor} (Llama 4 has none)"),
            (cfg.bias_update_rate, f"bias_update_rate={cfg.bias_update_rate} (Llama 4 has no selection bias)"),
            (cfg.num_shared_experts != 1, f"num_shared_experts={cfg.num_shared_experts} (Llama 4 has one)"),
        ) if bad]
        if problems:
            raise UserError(f"this model has no Hugging Face Llama 4 equivalent: {'; '.join(problems)}")
        text = None
        if base is not None:  # the text model's keys of the config an import came from
            text = {**base.get("text_config", base)}
            text.pop("quantization_config", None)
        types = {"chunk": "chunked_attention", "full": "full_attention", "nope": "full_attention"}
        return common_config_to_hf(
            cfg, dtype, text, 131072, architectures=[self.architecture], model_type=self.model_type,
            attention_bias=cfg.attention_bias, intermediate_size=cfg.expert_ffn_dim,
            intermediate_size_mlp=cfg.dense_ffn_dim, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
            moe_layers=list(cfg.moe_layers), interleave_moe_layer_step=cfg.moe_layer_step,
            no_rope_layers=[int(kind != "nope") for kind in kinds], layer_types=[types[kind] for kind in kinds],
            attention_chunk_size=cfg.attention_chunk or 8192, use_qk_norm=cfg.qk_l2_norm,
            attn_temperature_tuning=cfg.attn_temperature_tuning, floor_scale=cfg.floor_scale,
            attn_scale=cfg.attn_scale, router_aux_loss_coef=(text or {}).get("router_aux_loss_coef", 0.001),
        )

    def known(self, hf_name: str) -> bool:
        return (map_name(hf_name.removeprefix(PREFIX), _HF_TO_DTRAIN) is not None
                or hf_name.startswith(_OTHER_TOWERS))

    def layout(self, hf_names: Iterable[str], hf_config: dict[str, Any] | None = None) -> str:
        return PUBLISHED if (hf_config or {}).get("model_type") == "llama4" else TEXT

    def ignored(self, hf_name: str, cfg) -> bool:
        return hf_name.startswith(_OTHER_TOWERS)

    def pieces(self, name: str, cfg: Llama4Config, layout: str) -> list[Piece]:
        prefix = PREFIX if layout == PUBLISHED else ""
        m = _EXPERTS.match(name)
        if m is not None:
            what = m.group("what")
            hf_name = map_name(f"blocks.{m.group('i')}.moe.experts.{'w_down' if what == 'w_down' else 'w_gate'}",
                               _DTRAIN_TO_HF)
            if what == "w_down":
                return [Piece(prefix + hf_name, transposed=True)]
            return [Piece(prefix + hf_name, half=("w_gate", "w_up").index(what), split_dim=2, transposed=True)]
        hf_name = map_name(name, _DTRAIN_TO_HF)
        assert hf_name is not None, name
        rows = (cfg.head_dim, 0, cfg.head_dim) if _ROPE_PROJECTIONS.match(name) else None
        return [Piece(prefix + hf_name, rope_rows=rows)]


def _layer_kinds(hf: dict[str, Any], layers: int, source: str) -> list[str]:
    """dtrain's kind of each layer from no_rope_layers (or its interval) and layer_types."""
    interval = hf.get("no_rope_layer_interval", 4)
    rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    # transformers reads the first num_hidden_layers entries, each as true or false: 2 or "0" would pass.
    if not (isinstance(rope, list) and all(type(uses) in (int, bool) and uses in (0, 1) for uses in rope)):
        raise UserError(f"{source}: no_rope_layers={rope!r} must hold 1 (RoPE) or 0 (NoPE) for each layer")
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or ["chunked_attention" if uses and chunk is not None else "full_attention"
                                      for uses in rope]
    if len(rope) < layers or len(types) != layers:
        raise UserError(f"{source}: no_rope_layers {rope} and layer_types {types} must cover the {layers} layers")
    kinds = []
    for i, (uses_rope, kind) in enumerate(zip(rope, types)):
        if kind not in ("chunked_attention", "full_attention") or (kind == "chunked_attention" and not uses_rope):
            raise UserError(f"{source}: layer {i} is {kind} {'with' if uses_rope else 'without'} RoPE; dtrain's "
                            f"Llama 4 has chunked or full RoPE layers and full NoPE layers")
        kinds.append(("chunk" if kind == "chunked_attention" else "full") if uses_rope else "nope")
    if "chunk" in kinds and chunk is None:
        raise UserError(f"{source}: chunked_attention layers need attention_chunk_size")
    return kinds


def _moe_rule(hf: dict[str, Any], layers: int, source: str) -> tuple[int, tuple[int, ...]]:
    """(moe_layer_step, dense_layers) of moe_layers, or of interleave_moe_layer_step where it is not given."""
    step = hf.get("interleave_moe_layer_step") or 1
    listed = layer_indices(hf, "moe_layers", layers, source)
    if listed is None:
        return step, ()
    if sorted(listed) == list(range(step - 1, layers, step)):
        return step, ()
    return 1, tuple(i for i in range(layers) if i not in listed)


FAMILY = Llama4()
