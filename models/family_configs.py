"""The configs of gpt-oss and Llama 4 (text): MoEConfig's decoder with the parts of their own set by
default, and the few fields no other family has."""

from __future__ import annotations

import attrs

from models.config import ClampedSwiGLU, MoEConfig, RopeScaling, YarnScaling
from models.errors import UserError


@attrs.frozen
class GptOssConfig(MoEConfig):
    """gpt-oss: GQA attention with biases and a sink logit per head, windowed and full layers
    alternating (layer_pattern "window-full"), YaRN; every block MoE, the router biased, its top k
    chosen by logit and weighted by a softmax over the chosen (softmax over all, renormalised: the
    same), the experts biased with the clamped SwiGLU (`ClampedSwiGLU`)."""

    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope_scaling: YarnScaling | None = None
    attention_bias: bool = True
    attention_sinks: bool = True
    expert_bias: bool = True
    router_logit_bias: bool = True

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name in ("swiglu_limit", "swiglu_alpha"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name}={getattr(self, name)} must be > 0")
        if self.score_func != "softmax" or not self.route_norm:
            raise UserError(f"gpt-oss weights its top-k experts by a softmax over their logits: score_func "
                            f"{self.score_func!r} and route_norm={self.route_norm} must be 'softmax' and true")

    @property
    def expert_glu(self) -> ClampedSwiGLU:
        return ClampedSwiGLU(self.swiglu_limit, self.swiglu_alpha)


@attrs.frozen
class Llama4Config(MoEConfig):
    """Llama 4 (text): GQA attention where RoPE layers attend within chunks of absolute positions
    (layer_pattern "chunk-chunk-chunk-nope", attention_chunk) and every fourth layer has no
    position encoding and attends to the whole causal context; a sigmoid top-1 router whose score
    scales the expert's input, an always-on shared expert of the experts' width; MoE on every
    moe_layer_step-th block, a dense SwiGLU of dense_ffn_dim on the others.

    qk_l2_norm: queries and keys of the RoPE layers go through an RMSNorm without weight after RoPE
    (Scout; Maverick has none). attn_temperature_tuning: NoPE layers multiply their queries by
    1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)), p the token's absolute position in the row."""

    qk_l2_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    rope_scaling: RopeScaling | None = None
    score_func: str = "sigmoid"
    route_norm: bool = False
    scale_expert_inputs: bool = True
    top_k: int = 1
    num_shared_experts: int = 1
    # Llama4ForCausalLM adds no load-balancing loss to its loss.
    aux_loss_coef: float = 0.0
    layer_pattern: str = "chunk-chunk-chunk-nope"
    attention_chunk: int | None = 8192

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.floor_scale < 1:
            raise UserError(f"floor_scale={self.floor_scale} must be >= 1")
        if self.num_shared_experts > 1:
            raise UserError(f"num_shared_experts={self.num_shared_experts}: Llama 4 has one shared expert of the "
                            f"experts' width; use 0 or 1")
