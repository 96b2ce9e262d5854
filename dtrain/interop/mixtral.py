"""Hugging Face Mixtral checkpoints <-> dtrain's MoE model (`models.mixtral`).

Mixtral is dtrain's MoEConfig with softmax routing, top-k renormalised (route_norm; transformers'
MixtralTopKRouter takes softmax over all experts, keeps the top k and divides by their sum, which
equals a softmax over the k chosen logits), no shared experts, no dense layers, no selection bias,
dropless. Attention, norms, embedding and head are named as for Llama.

Two tensor layouts are read, one written:
- the hub's (what `save_pretrained` writes by default, transformers 4 and 5): one tensor per expert,
  `model.layers.{i}.block_sparse_moe.experts.{j}.w1/w3/w2.weight` (gate [F, D], up [F, D],
  down [D, F]) and `...block_sparse_moe.gate.weight` [E, D], the router;
- transformers >= 5's in-memory one (`save_pretrained(save_original_format=False)`): experts fused,
  `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2F, D] (gate rows, then up rows) and
  `...mlp.experts.down_proj` [E, D, F], router `...mlp.gate.weight`.
dtrain stacks experts: `blocks.{i}.moe.experts.w_gate`/`w_up` [E, F, D], `w_down` [E, D, F].

The load-balancing loss is defined differently. transformers pools the router statistics of all
L layers into one Switch loss over top-k choices, `E * sum_e (k f_e) P_e` (f_e: the share of
expert e among all layers' choices, P_e: its mean probability over all layers' tokens), while
dtrain adds one Switch loss per layer, `E * sum_e f_le P_le`. Where every layer's load is the
pooled load (a balanced router, which a trained checkpoint has), the two give each layer's router
the same gradient when dtrain's coefficient is transformers' times k / L: `router_aux_loss_coef`
is converted so on import, and back on export."""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from dtrain.interop.family import (
    SHARED_NAMES, HFFamily, Piece, common_config_from_hf, common_config_to_hf, map_name, name_tables, pattern,
)
from models.config import MoEConfig
from models.errors import UserError

# dtrain name (after `blocks.{i}.moe.`) -> (HF template, how: None whole, "expert" one per expert,
# 0 / 1 the first / second half of dim 1), per layout.
LAYOUTS: dict[str, dict[str, tuple[str, Any]]] = {
    "hub": {
        "router": ("model.layers.{i}.block_sparse_moe.gate.weight", None),
        "experts.w_gate": ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", "expert"),
        "experts.w_up": ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", "expert"),
        "experts.w_down": ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", "expert"),
    },
    "fused": {
        "router": ("model.layers.{i}.mlp.gate.weight", None),
        "experts.w_gate": ("model.layers.{i}.mlp.experts.gate_up_proj", 0),
        "experts.w_up": ("model.layers.{i}.mlp.experts.gate_up_proj", 1),
        "experts.w_down": ("model.layers.{i}.mlp.experts.down_proj", None),
    },
}
_PATTERNS = {layout: [pattern(t) for t, _ in names.values()] for layout, names in LAYOUTS.items()}
_MOE_NAME = re.compile(r"^blocks\.(?P<i>\d+)\.moe\.(?P<what>.+)$")
_SHARED_TO_DTRAIN, _SHARED_TO_HF = name_tables(SHARED_NAMES)


def aux_loss_coef_from_hf(router_aux_loss_coef: float, top_k: int, num_layers: int) -> float:
    """dtrain's per-layer coefficient for transformers' pooled one (the module docstring)."""
    return _without_float_noise(router_aux_loss_coef * top_k / num_layers)


def aux_loss_coef_to_hf(aux_loss_coef: float, top_k: int, num_layers: int) -> float:
    return _without_float_noise(aux_loss_coef * num_layers / top_k)


def _without_float_noise(value: float) -> float:
    # 12 significant digits: an import and export give back the checkpoint's 0.001, not 0.0010000000000000002.
    return float(f"{value:.12g}")


class Mixtral(HFFamily):
    model_type, architecture, title, config_cls = "mixtral", "MixtralForCausalLM", "Mixtral", MoEConfig
    preset_hint = "a Mixtral (MoE) preset such as mixtral-8x7b"
    # Training choices that change neither the parameters nor the model's function: a run that
    # starts from a Mixtral checkpoint may pick its own (a router_bias starts at zero).
    free_fields = frozenset({"init_std", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor"})
    config_types = {"num_local_experts": "count", "num_experts_per_tok": "count", "router_aux_loss_coef": "number"}

    def describes(self, cfg) -> bool:
        return type(cfg) is MoEConfig and not cfg.qk_norm  # with qk-norm: Qwen3-MoE

    def config_from_hf(self, cfg: dict[str, Any], source: str) -> MoEConfig:
        window = cfg.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise UserError(f"{source}: sliding_window={window!r} is not a positive number of tokens; set it to "
                            f"the model's window, or null for full causal attention")
        common = common_config_from_hf(cfg, source, self.title, default_theta=1e6, default_eps=1e-5)
        top_k = cfg["num_experts_per_tok"]
        aux_loss_coef = aux_loss_coef_from_hf(float(cfg.get("router_aux_loss_coef", 0.001)), top_k,
                                              common["num_layers"])
        return MoEConfig(
            num_experts=cfg["num_local_experts"], top_k=top_k,
            expert_ffn_dim=cfg["intermediate_size"], num_shared_experts=0, score_func="softmax",
            route_norm=True, aux_loss_coef=aux_loss_coef, z_loss_coef=0.0,
            bias_update_rate=0.0, capacity_factor=None, first_dense_layers=0, dense_ffn_dim=0,
            sliding_window=window, **common,
        )

    def config_to_hf(self, cfg: MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        problems = [what for bad, what in (
            (cfg.num_shared_experts, f"num_shared_experts={cfg.num_shared_experts} (Mixtral has no shared experts)"),
            (cfg.num_expert_groups > 1, f"num_expert_groups={cfg.num_expert_groups} (Mixtral routes over all experts)"),
            (cfg.routed_scaling_factor != 1, f"routed_scaling_factor={cfg.routed_scaling_factor} (Mixtral has none)"),
            (cfg.score_func != "softmax", f"score_func={cfg.score_func!r} (Mixtral routes by softmax)"),
            (not cfg.route_norm, "route_norm=False (Mixtral renormalises its top-k weights)"),
            (len(cfg.moe_layers) < cfg.num_layers,
             f"dense blocks {sorted(set(range(cfg.num_layers)) - set(cfg.moe_layers))} (every Mixtral layer is MoE)"),
            (cfg.bias_update_rate, f"bias_update_rate={cfg.bias_update_rate} (Mixtral has no router selection bias)"),
        ) if bad]
        if problems:
            raise UserError(f"this MoE model has no Hugging Face equivalent: {'; '.join(problems)}; only "
                            f"Mixtral-shaped models are exported")
        return common_config_to_hf(
            cfg, dtype, base, 32768, architectures=[self.architecture], model_type=self.model_type,
            intermediate_size=cfg.expert_ffn_dim, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
            router_aux_loss_coef=aux_loss_coef_to_hf(cfg.aux_loss_coef, cfg.top_k, cfg.num_layers),
            sliding_window=cfg.sliding_window,
        )

    def known(self, hf_name: str) -> bool:
        return (map_name(hf_name, _SHARED_TO_DTRAIN) is not None
                or any(p.match(hf_name) for patterns in _PATTERNS.values() for p in patterns))

    def layout(self, hf_names: Iterable[str], hf_config: dict[str, Any] | None = None) -> str:
        """The fused layout when any name has it, else the hub's (a mix then fails as unexpected tensors)."""
        return "fused" if any(p.match(n) for n in hf_names for p in _PATTERNS["fused"]) else "hub"

    def pieces(self, name: str, cfg: MoEConfig, layout: str) -> list[Piece]:
        m = _MOE_NAME.match(name)
        if m is None:
            hf_name = map_name(name, _SHARED_TO_HF)
            assert hf_name is not None, name
            return [Piece(hf_name)]
        template, how = LAYOUTS[layout][m.group("what")]
        template = template.replace("{i}", m.group("i"))
        if how == "expert":
            return [Piece(template.replace("{j}", str(j)), expert=j) for j in range(cfg.num_experts)]
        return [Piece(template, half=how)]


FAMILY = Mixtral()
