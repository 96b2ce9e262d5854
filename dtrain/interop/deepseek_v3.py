"""Hugging Face DeepSeek-V3 checkpoints (`DeepseekV3ForCausalLM`, and DeepSeek's published layout
with its multi-token prediction module) <-> dtrain's DeepSeek model (`models.deepseek`).

transformers' DeepSeek-V3 routes by sigmoid scores with the selection bias
(`mlp.gate.e_score_correction_bias`, dtrain's `router_bias`), over `n_group` groups of which each
token keeps `topk_group` (a group scoring its two best experts), renormalises the top-k weights
(`norm_topk_prob`) and multiplies them by `routed_scaling_factor`; the first
`first_k_dense_replace` layers are dense. Its attention is MLA with YaRN or plain RoPE.

Layouts read: the hub's (one tensor per expert, `mlp.experts.{j}.gate_proj/up_proj/down_proj`, what
`save_pretrained` and DeepSeek write) and transformers >= 5's fused one (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`). Written: the hub's, and DeepSeek's MTP layout: module k is layer
num_hidden_layers + k, with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, a decoder layer, and
copies of the embedding and output head (`embed_tokens`, `shared_head.head`), which an import
skips. A checkpoint without MTP tensors (what transformers saves) imports with mtp_depth 0; a run
with MTP modules then starts them from their initialisation.

RoPE: DeepSeek's checkpoints pair the rotary dims interleaved (`rope_interleave`, transformers'
default), dtrain rotates halves; the rotary rows of the query projection and of the shared key
(`kv_a_proj_with_mqa`) are reordered on import and back on export, which gives the same scores.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import attrs
import torch

from dtrain.interop.family import HFFamily, Piece, map_name, name_tables, pattern
from models.config import DeepSeekConfig, YarnScaling
from models.errors import UserError

TOP = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "head.norm"),
    ("lm_head.weight", "head.output"),
]
# A block's tensors: (HF name after `model.layers.{i}.`, dtrain name after the block's path).
BLOCK = [
    ("input_layernorm.weight", "attn_norm"),
    ("post_attention_layernorm.weight", "mlp_norm"),
    ("self_attn.q_proj.weight", "attn.wq"),
    ("self_attn.q_a_proj.weight", "attn.wq_a"),
    ("self_attn.q_a_layernorm.weight", "attn.q_norm"),
    ("self_attn.q_b_proj.weight", "attn.wq_b"),
    ("self_attn.kv_a_proj_with_mqa.weight", "attn.wkv_a"),
    ("self_attn.kv_a_layernorm.weight", "attn.kv_norm"),
    ("self_attn.kv_b_proj.weight", "attn.wkv_b"),
    ("self_attn.o_proj.weight", "attn.wo"),
    ("mlp.gate_proj.weight", "mlp.w_gate"),
    ("mlp.up_proj.weight", "mlp.w_up"),
    ("mlp.down_proj.weight", "mlp.w_down"),
    ("mlp.gate.weight", "moe.router"),
    ("mlp.gate.e_score_correction_bias", "moe.router_bias"),
    ("mlp.shared_experts.gate_proj.weight", "moe.shared.w_gate"),
    ("mlp.shared_experts.up_proj.weight", "moe.shared.w_up"),
    ("mlp.shared_experts.down_proj.weight", "moe.shared.w_down"),
]
# Routed experts, per layout: dtrain name -> (HF name after the layer, how: "expert" one tensor per
# expert, 0 / 1 the first / second half of dim 1, None whole).
EXPERTS = {
    "hub": {"moe.experts.w_gate": ("mlp.experts.{j}.gate_proj.weight", "expert"),
            "moe.experts.w_up": ("mlp.experts.{j}.up_proj.weight", "expert"),
            "moe.experts.w_down": ("mlp.experts.{j}.down_proj.weight", "expert")},
    "fused": {"moe.experts.w_gate": ("mlp.experts.gate_up_proj", 0),
              "moe.experts.w_up": ("mlp.experts.gate_up_proj", 1),
              "moe.experts.w_down": ("mlp.experts.down_proj", None)},
}
# An MTP module's own tensors (HF name after `model.layers.{L+k}.`, dtrain name after `mtp.{k}.`),
# and the copies of shared weights the published layout gives it.
MTP = [("enorm.weight", "enorm"), ("hnorm.weight", "hnorm"), ("eh_proj.weight", "eh_proj"),
       ("shared_head.norm.weight", "norm")]
MTP_COPIES = {"embed.weight": "embed_tokens.weight", "head.output": "shared_head.head.weight"}

_TOP_TO_DTRAIN, _TOP_TO_HF = name_tables(TOP)
_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")
_BLOCK_NAMES = {hf for hf, _ in BLOCK} | {hf for hf, _ in MTP} | set(MTP_COPIES.values())
_EXPERT_PATTERNS = [pattern(t) for names in EXPERTS.values() for t, _ in names.values()]
_DTRAIN_BLOCK = re.compile(r"^(?:blocks\.(?P<i>\d+)|mtp\.(?P<k>\d+)\.block)\.(?P<rest>.+)$")
_DTRAIN_MTP = re.compile(r"^mtp\.(?P<k>\d+)\.(?P<rest>enorm|hnorm|eh_proj|norm)$")
INTERLEAVED = "/interleaved"


class DeepseekV3(HFFamily):
    model_type, architecture, title, config_cls = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3", DeepSeekConfig
    preset_hint = "a DeepSeek preset such as deepseek-v3 (or tiny-mla with --model-overrides)"
    # Training choices: a run may pick its own, and add or leave out MTP modules.
    free_fields = frozenset({"init_std", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor",
                             "mtp_depth", "mtp_loss_weight"})
    export_layout = "published"
    config_types = {
        "n_routed_experts": "count", "num_experts_per_tok": "count", "moe_intermediate_size": "count",
        "n_shared_experts": "count0?", "n_group": "count?", "topk_group": "count?", "first_k_dense_replace": "count0?",
        "q_lora_rank": "count0?", "kv_lora_rank": "count", "qk_nope_head_dim": "count", "qk_rope_head_dim": "count",
        "v_head_dim": "count", "num_nextn_predict_layers": "count0", "routed_scaling_factor": "number",
        "norm_topk_prob": "flag", "aux_loss_alpha": "number",
    }

    def config_from_hf(self, hf: dict[str, Any], source: str) -> DeepSeekConfig:
        unsupported = {key: hf.get(key) for key, ok in (("hidden_act", "silu"), ("attention_bias", False),
                                                        ("scoring_func", "sigmoid")) if hf.get(key, ok) != ok}
        if unsupported:
            raise UserError(f"{source}: {unsupported} differ from DeepSeek-V3 (silu, no attention biases, sigmoid "
                            f"routing); this checkpoint cannot be imported")
        quantized = (hf.get("quantization_config") or {}).get("quant_method")
        if quantized:
            raise UserError(f"{source}: the weights are {quantized}-quantized (DeepSeek publishes V3 in FP8 blocks); "
                            f"convert them to bf16 first (DeepSeek's inference/fp8_cast_bf16.py) and import that")
        heads = hf["num_attention_heads"]
        if hf.get("num_key_value_heads") not in (None, heads):
            raise UserError(f"{source}: num_key_value_heads={hf['num_key_value_heads']} but MLA has one key and value "
                            f"per head ({heads})")
        theta, scaling = _rope_from_hf(hf, source)
        return DeepSeekConfig(
            dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
            vocab_size=hf["vocab_size"], num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
            expert_ffn_dim=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
            score_func="sigmoid", route_norm=bool(hf.get("norm_topk_prob", True)),
            num_expert_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            aux_loss_coef=float(hf.get("aux_loss_alpha", 0.0001)), bias_update_rate=0.001,
            first_dense_layers=hf.get("first_k_dense_replace") or 0, dense_ffn_dim=hf["intermediate_size"],
            q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], mtp_depth=hf.get("num_nextn_predict_layers", 0),
            rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def config_to_hf(self, cfg: DeepSeekConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        if cfg.score_func != "sigmoid":
            raise UserError(f"this DeepSeek model routes by {cfg.score_func}, but transformers' DeepSeek-V3 by "
                            f"sigmoid scores; it has no Hugging Face equivalent to export to")
        if cfg.moe_layer_step != 1 or cfg.dense_layers:
            raise UserError(f"moe_layer_step={cfg.moe_layer_step}, dense_layers={list(cfg.dense_layers)}: transformers' "
                            f"DeepSeek-V3 has dense blocks only before the first MoE one (first_k_dense_replace); "
                            f"export a model whose dense blocks are its first_dense_layers")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        max_positions = 4096
        if cfg.rope_scaling is not None:
            s = cfg.rope_scaling
            rope.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_seq_len,
                        beta_fast=s.beta_fast, beta_slow=s.beta_slow, mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)
            max_positions = int(s.original_max_seq_len * s.factor)
        out = dict(base or {"max_position_embeddings": max_positions, "rope_interleave": True})
        out.update(
            architectures=[self.architecture], model_type=self.model_type, hidden_size=cfg.dim,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
            vocab_size=cfg.vocab_size, intermediate_size=cfg.dense_ffn_dim or cfg.expert_ffn_dim,
            moe_intermediate_size=cfg.expert_ffn_dim, n_routed_experts=cfg.num_experts,
            n_shared_experts=cfg.num_shared_experts, num_experts_per_tok=cfg.top_k, n_group=cfg.num_expert_groups,
            topk_group=cfg.topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
            norm_topk_prob=cfg.route_norm, first_k_dense_replace=cfg.first_dense_layers,
            q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
            num_nextn_predict_layers=cfg.mtp_depth, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            hidden_act="silu", attention_bias=False, rope_parameters=rope, rope_theta=cfg.rope_theta,
            rope_scaling=None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        )
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
        return out

    def known(self, hf_name: str) -> bool:
        if map_name(hf_name, _TOP_TO_DTRAIN) is not None:
            return True
        m = _LAYER.match(hf_name)
        return m is not None and (m.group("rest") in _BLOCK_NAMES or any(p.match(m.group("rest")) for p in _EXPERT_PATTERNS))

    def layout(self, hf_names: Iterable[str], hf_config: dict[str, Any] | None = None) -> str:
        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in hf_names)
        return ("fused" if fused else "hub") + (INTERLEAVED if _interleaved(hf_config) else "")

    def export_layout_of(self, base: dict[str, Any] | None) -> str:
        return self.export_layout + (INTERLEAVED if _interleaved(base) else "")

    def ignored(self, hf_name: str, cfg: DeepSeekConfig) -> bool:
        m = _LAYER.match(hf_name)
        return m is not None and int(m.group("i")) >= cfg.num_layers and m.group("rest") in MTP_COPIES.values()

    def with_tensors(self, cfg: DeepSeekConfig, hf_names: Iterable[str]) -> DeepSeekConfig:
        """config.json's num_nextn_predict_layers counts MTP modules a checkpoint may not carry
        (transformers saves none): the modules present are the ones imported."""
        layers = {int(m.group("i")) for m in map(_LAYER.match, hf_names) if m and int(m.group("i")) >= cfg.num_layers}
        depth = next(k for k in range(len(layers) + 1) if cfg.num_layers + k not in layers)
        return cfg if depth == cfg.mtp_depth else attrs.evolve(cfg, mtp_depth=depth)

    def pieces(self, name: str, cfg: DeepSeekConfig, layout: str) -> list[Piece]:
        tensors, interleaved = layout.split("/")[0], layout.endswith(INTERLEAVED)
        top = map_name(name, _TOP_TO_HF)
        if top is not None:
            copies = [f"model.layers.{cfg.num_layers + k}.{MTP_COPIES[name]}" for k in range(cfg.mtp_depth)
                      if tensors == "published" and name in MTP_COPIES]
            return [Piece(hf) for hf in [top, *copies]]
        if m := _DTRAIN_MTP.match(name):
            hf_rest = {d: h for h, d in MTP}[m.group("rest")]
            return [Piece(f"model.layers.{cfg.num_layers + int(m.group('k'))}.{hf_rest}")]
        m = _DTRAIN_BLOCK.match(name)
        assert m is not None, name
        layer = int(m.group("i")) if m.group("i") is not None else cfg.num_layers + int(m.group("k"))
        prefix, rest = f"model.layers.{layer}.", m.group("rest")
        experts = EXPERTS["fused" if tensors == "fused" else "hub"]
        if rest in experts:
            template, how = experts[rest]
            if how == "expert":
                return [Piece(prefix + template.replace("{j}", str(j)), expert=j) for j in range(cfg.num_experts)]
            return [Piece(prefix + template, half=how)]
        hf_rest = {d: h for h, d in BLOCK}[rest]
        return [Piece(prefix + hf_rest, rope_rows=_rope_rows(rest, cfg) if interleaved else None)]


def _interleaved(hf_config: dict[str, Any] | None) -> bool:
    return bool((hf_config or {}).get("rope_interleave", True))


def _rope_rows(rest: str, cfg: DeepSeekConfig) -> tuple[int, int, int] | None:
    """Where a projection's rotary output rows are: in each head of q, after the key part of wkv_a."""
    if rest in ("attn.wq", "attn.wq_b"):
        return cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if rest == "attn.wkv_a":
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return None


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, YarnScaling | None]:
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return float(rope["rope_theta"]), None
    if kind != "yarn" or rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise UserError(f"{source}: RoPE {rope} is not supported; dtrain's DeepSeek has plain RoPE and YaRN "
                        f"(without an explicit attention_factor or truncate)")
    return float(rope["rope_theta"]), YarnScaling(
        factor=float(rope["factor"]), original_max_seq_len=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))


FAMILY = DeepseekV3()
