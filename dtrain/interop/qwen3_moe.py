"""Hugging Face Qwen3-MoE checkpoints (`Qwen3MoeForCausalLM`) <-> dtrain's MoE model with qk-norm.

Qwen3-MoE is Qwen3's attention (`dtrain.interop.qwen3`: explicit head_dim, qk-norm) with dtrain's
MoE feed-forward: router logits x W_g^T, softmax over all experts, the top k probabilities,
divided by their sum where `norm_topk_prob` (route_norm), weighting SwiGLU experts; no shared
expert, no selection bias. Block i is MoE iff i is not in `mlp_only_layers` and
(i + 1) % `decoder_sparse_step` == 0 (dtrain's dense_layers and moe_layer_step); the other blocks
are dense SwiGLUs of `intermediate_size` (dense_ffn_dim). transformers 5 names the expert count
`num_local_experts` where the published configs say `num_experts`: either is read.

Two expert layouts are read, the hub's written (as for Mixtral, `dtrain.interop.mixtral`): one
tensor per expert, `mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`, or transformers >= 5's
fused `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows, then up rows) and `mlp.experts.down_proj`
[E, D, F]; the router is `mlp.gate.weight` [E, D], dense blocks `mlp.gate_proj/up_proj/down_proj`.

The load-balancing coefficient is converted as Mixtral's: transformers pools the statistics of
its MoE layers into one loss, dtrain adds one per MoE layer (x top_k / MoE layers on import).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import attrs
import torch

from dtrain.interop import qwen3
from dtrain.interop.family import (
    SHARED_NAMES, HFFamily, Piece, common_config_from_hf, common_config_to_hf, layer_indices, map_name, name_tables,
    pattern,
)
from dtrain.interop.mixtral import aux_loss_coef_from_hf, aux_loss_coef_to_hf
from models.config import MoEConfig
from models.errors import UserError

DENSE_NAMES = [
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.w_gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.w_up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.w_down"),
    ("model.layers.{i}.mlp.gate.weight", "blocks.{i}.moe.router"),
]
# dtrain name after `blocks.{i}.moe.` -> (HF name after `model.layers.{i}.`, how: "expert" one tensor
# per expert, 0 / 1 the first / second half of dim 1, None whole), per layout.
EXPERTS = {
    "hub": {"experts.w_gate": ("mlp.experts.{j}.gate_proj.weight", "expert"),
            "experts.w_up": ("mlp.experts.{j}.up_proj.weight", "expert"),
            "experts.w_down": ("mlp.experts.{j}.down_proj.weight", "expert")},
    "fused": {"experts.w_gate": ("mlp.experts.gate_up_proj", 0),
              "experts.w_up": ("mlp.experts.gate_up_proj", 1),
              "experts.w_down": ("mlp.experts.down_proj", None)},
}
_PATTERNS = {layout: [pattern("model.layers.{i}." + t) for t, _ in names.values()] for layout, names in EXPERTS.items()}
_EXPERT_NAME = re.compile(r"^blocks\.(?P<i>\d+)\.moe\.(?P<what>experts\..+)$")
_HF_TO_DTRAIN, _DTRAIN_TO_HF = name_tables(SHARED_NAMES + qwen3.QK_NORM_NAMES + DENSE_NAMES)


class Qwen3MoE(HFFamily):
    model_type, architecture, title, config_cls = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", MoEConfig
    preset_hint = "a Qwen3-MoE preset such as qwen3-30b-a3b (or tiny-qwen3-moe with --model-overrides)"
    # As Mixtral's: training choices that change neither the parameters nor the model's function.
    free_fields = frozenset({"init_std", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"})
    config_types = {**qwen3.CONFIG_TYPES, "num_experts": "count", "num_local_experts": "count",
                    "num_experts_per_tok": "count", "moe_intermediate_size": "count", "decoder_sparse_step": "count",
                    "norm_topk_prob": "flag", "router_aux_loss_coef": "number"}

    def describes(self, cfg) -> bool:
        return type(cfg) is MoEConfig and cfg.qk_norm

    def config_from_hf(self, hf: dict[str, Any], source: str) -> MoEConfig:
        common = common_config_from_hf(hf, source, self.title, default_theta=1e6, default_eps=1e-6)
        counts = {hf[key] for key in ("num_experts", "num_local_experts") if key in hf}
        if len(counts) != 1:
            raise UserError(f"{source}: config.json gives num_experts={hf.get('num_experts')!r} and num_local_experts="
                            f"{hf.get('num_local_experts')!r}; it needs one expert count (either key)")
        dense = layer_indices(hf, "mlp_only_layers", common["num_layers"], source) or []
        cfg = MoEConfig(
            num_experts=counts.pop(), top_k=hf["num_experts_per_tok"], expert_ffn_dim=hf["moe_intermediate_size"],
            dense_ffn_dim=hf["intermediate_size"], moe_layer_step=hf.get("decoder_sparse_step", 1),
            dense_layers=tuple(sorted(set(dense))), route_norm=bool(hf.get("norm_topk_prob", False)),
            score_func="softmax", num_shared_experts=0, z_loss_coef=0.0, bias_update_rate=0.0, capacity_factor=None,
            qk_norm=True, sliding_window=qwen3.sliding_window_from_hf(hf, source),
            **{**common, "head_dim": hf.get("head_dim") or common["dim"] // common["num_heads"]},
        )
        coef = float(hf.get("router_aux_loss_coef", 0.001))
        return attrs.evolve(cfg, aux_loss_coef=aux_loss_coef_from_hf(coef, cfg.top_k, len(cfg.moe_layers)))

    def config_to_hf(self, cfg: MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        problems = [what for bad, what in (
            (cfg.num_shared_experts, f"num_shared_experts={cfg.num_shared_experts} (Qwen3-MoE has no shared experts)"),
            (cfg.num_expert_groups > 1, f"num_expert_groups={cfg.num_expert_groups} (Qwen3-MoE routes over all experts)"),
            (cfg.routed_scaling_factor != 1, f"routed_scaling_factor={cfg.routed_scaling_factor} (Qwen3-MoE has none)"),
            (cfg.score_func != "softmax", f"score_func={cfg.score_func!r} (Qwen3-MoE routes by softmax)"),
            (cfg.bias_update_rate, f"bias_update_rate={cfg.bias_update_rate} (Qwen3-MoE has no selection bias)"),
        ) if bad]
        if problems:
            raise UserError(f"this MoE model has no Hugging Face equivalent: {'; '.join(problems)}; only "
                            f"Qwen3-MoE-shaped models are exported with qk_norm")
        step = cfg.moe_layer_step
        # The blocks the step leaves MoE that are dense (dtrain's first_dense_layers and dense_layers).
        mlp_only = [i for i in range(cfg.num_layers) if (i + 1) % step == 0 and not cfg.is_moe_layer(i)]
        return common_config_to_hf(
            cfg, dtype, base, 40960, architectures=[self.architecture], model_type=self.model_type,
            intermediate_size=cfg.dense_ffn_dim or cfg.expert_ffn_dim, moe_intermediate_size=cfg.expert_ffn_dim,
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.route_norm,
            decoder_sparse_step=step, mlp_only_layers=mlp_only,
            router_aux_loss_coef=aux_loss_coef_to_hf(cfg.aux_loss_coef, cfg.top_k, len(cfg.moe_layers)),
            **qwen3.attention_to_hf(cfg),
        )

    def known(self, hf_name: str) -> bool:
        return (map_name(hf_name, _HF_TO_DTRAIN) is not None
                or any(p.match(hf_name) for patterns in _PATTERNS.values() for p in patterns))

    def layout(self, hf_names: Iterable[str], hf_config: dict[str, Any] | None = None) -> str:
        """The fused layout when any name has it, else the hub's (a mix then fails as unexpected tensors)."""
        return "fused" if any(p.match(n) for n in hf_names for p in _PATTERNS["fused"]) else "hub"

    def pieces(self, name: str, cfg: MoEConfig, layout: str) -> list[Piece]:
        m = _EXPERT_NAME.match(name)
        if m is None:
            hf_name = map_name(name, _DTRAIN_TO_HF)
            assert hf_name is not None, name
            return [Piece(hf_name)]
        template, how = EXPERTS[layout][m.group("what")]
        template = f"model.layers.{m.group('i')}.{template}"
        if how == "expert":
            return [Piece(template.replace("{j}", str(j)), expert=j) for j in range(cfg.num_experts)]
        return [Piece(template, half=how)]


FAMILY = Qwen3MoE()
