"""Model shapes: the config class of each decoder family, with the checks of its fields."""

from __future__ import annotations

import math

import attrs

from models.errors import UserError


@attrs.frozen
class RopeScaling:
    """Llama-3.1 style frequency scaling of RoPE for long contexts."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@attrs.frozen
class YarnScaling:
    """YaRN (Peng et al. 2023) as DeepSeek-V2/V3 and gpt-oss configure it: wavelengths longer than the
    original context are interpolated by `factor`, short ones kept, a linear ramp between the dims
    that turn `beta_fast` and `beta_slow` times over it (rounded out to whole dims with `truncate`,
    DeepSeek's; at the fractional dims without, gpt-oss's); cos/sin are multiplied by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set (1 for DeepSeek's
    checkpoints), else by mscale(factor, 1); MLA's softmax scale by mscale(factor, mscale_all_dim) ** 2
    where that is set. 0 stands for "not set", as transformers reads these."""

    factor: float = 40.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_factor`)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


@attrs.frozen
class ClampedSwiGLU:
    """The routed experts' gated unit of gpt-oss in place of SwiGLU's silu(gate) * up:
    gate = min(gate, limit), up = clamp(up, -limit, limit), out = gate * sigmoid(alpha * gate) * (up + 1)."""

    limit: float = 7.0
    alpha: float = 1.702


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@attrs.frozen
class LlamaConfig:
    """A dense Llama-style decoder: GQA attention, RoPE, RMSNorm, SwiGLU."""

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Mistral-style sliding-window attention: each token sees itself and the window - 1 before it.
    sliding_window: int | None = None
    # The width of one attention head; None: dim // num_heads. Families whose query width
    # num_heads * head_dim is not dim (Qwen3-0.6B and -32B, gpt-oss) set it: q_proj is then
    # [num_heads * head_dim, dim], k/v_proj [num_kv_heads * head_dim, dim], o_proj
    # [dim, num_heads * head_dim], and RoPE turns head_dim dims. Read it as `cfg.head_dim`.
    explicit_head_dim: int | None = attrs.field(default=None, alias="head_dim")
    # Attention kinds per layer, `LAYER_KINDS` joined by "-" and cycled over the layers ("window-full":
    # even layers windowed, odd ones full); empty: every layer "window" with a sliding_window, else "full".
    layer_pattern: str = ""
    # Tokens per chunk of "chunk" layers: a query sees the keys of its own chunk of absolute positions.
    attention_chunk: int | None = None
    # Qwen3's qk-norm: each head's query and key RMS-normed over head_dim, before RoPE, with a
    # learned [head_dim] weight that all heads share (one for queries, one for keys).
    qk_norm: bool = False
    # Biases on the q, k, v and output projections (gpt-oss).
    attention_bias: bool = False
    # A learned logit per head that joins every query's softmax and is dropped (gpt-oss's sinks).
    attention_sinks: bool = False

    def __attrs_post_init__(self) -> None:
        _check_shape(self, ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size"))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return layer_kinds(self)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.num_heads


def _check_shape(cfg, positive: tuple[str, ...]) -> None:
    """The checks every decoder shares: positive sizes, whole heads, whole GQA groups."""
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UserError(f"model {name}={getattr(cfg, name)} must be >= 1")
    if cfg.explicit_head_dim is None and cfg.dim % cfg.num_heads:
        raise UserError(f"model dim={cfg.dim} is not divisible by num_heads={cfg.num_heads}; set head_dim "
                        f"where the heads are not dim / num_heads wide")
    if cfg.explicit_head_dim is not None and (cfg.explicit_head_dim < 2 or cfg.explicit_head_dim % 2):
        raise UserError(f"head_dim={cfg.explicit_head_dim} must be even and >= 2 (RoPE rotates pairs), "
                        f"or none for dim / num_heads")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(
            f"num_heads={cfg.num_heads} is not divisible by num_kv_heads={cfg.num_kv_heads}"
        )
    # Each a NaN at the first step otherwise: 0 or a negative theta or factor in RoPE's frequencies,
    # a negative eps under the norms' square root.
    for name, value in (("rope_theta", cfg.rope_theta), ("norm_eps", cfg.norm_eps),
                        ("rope_scaling factor", getattr(cfg.rope_scaling, "factor", 1.0))):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise UserError(f"model {name}={value} must be a positive number")
    if cfg.sliding_window is not None and cfg.sliding_window < 1:
        raise UserError(f"sliding_window={cfg.sliding_window} must be >= 1 (tokens each token sees, itself "
                        f"included), or none for full causal attention")
    _check_layer_pattern(cfg)


# What the attention of one layer is: "full" causal; "window", the last sliding_window keys; "chunk",
# the keys of the query's attention_chunk-token chunk (chunks of absolute positions in the row);
# "nope", full causal attention without RoPE (Llama 4's NoPE layers).
LAYER_KINDS = ("full", "window", "chunk", "nope")


def layer_kind(cfg, index: int) -> str:
    """The attention kind (`LAYER_KINDS`) of layer `index`: `layer_pattern` cycled over the layers
    (and on over multi-token prediction blocks, which number on from num_layers)."""
    if not cfg.layer_pattern:
        return "window" if cfg.sliding_window is not None else "full"
    pattern = cfg.layer_pattern.split("-")
    return pattern[index % len(pattern)]


def layer_kinds(cfg) -> tuple[str, ...]:
    return tuple(layer_kind(cfg, i) for i in range(cfg.num_layers))


def _check_layer_pattern(cfg) -> None:
    pattern = cfg.layer_pattern.split("-") if cfg.layer_pattern else []
    unknown = [kind for kind in pattern if kind not in LAYER_KINDS]
    if unknown:
        raise UserError(f"layer_pattern={cfg.layer_pattern!r} names {unknown[0]!r}; its kinds, joined by '-' "
                        f"and repeated over the layers, are {', '.join(LAYER_KINDS)}")
    kinds = set(layer_kinds(cfg))
    for kind, field, value in (("window", "sliding_window", cfg.sliding_window),
                               ("chunk", "attention_chunk", cfg.attention_chunk)):
        if kind in kinds and value is None:
            raise UserError(f"layer_pattern={cfg.layer_pattern!r} has {kind!r} layers but {field} is none; set it")
        if value is not None and kind not in kinds:
            raise UserError(f"{field}={value} is set but no layer is a {kind!r} layer (layer_pattern="
                            f"{cfg.layer_pattern!r}); set {field}=none or add {kind!r} to the pattern")
    if cfg.attention_chunk is not None and cfg.attention_chunk < 1:
        raise UserError(f"attention_chunk={cfg.attention_chunk} must be >= 1, or none")


SCORE_FUNCS = ("softmax", "sigmoid")


@attrs.frozen
class MoEConfig:
    """A sparse Mixtral/DeepSeek-style decoder: Llama attention, a routed mixture of SwiGLU experts
    in place of the dense feed-forward (optionally plus always-on shared experts)."""

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    # One SwiGLU of width num_shared_experts * expert_ffn_dim that every token goes through (DeepSeekMoE).
    num_shared_experts: int = 0
    score_func: str = "softmax"
    # Renormalise each token's top-k weights to sum to 1 (Mixtral's softmax over the chosen logits).
    route_norm: bool = True
    # Switch/GShard load-balancing loss num_experts * sum_e f_e * P_e, and the router z-loss.
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    # Auxiliary-loss-free balancing (DeepSeek-V3): per-expert selection bias moved by this much
    # per step towards balance; 0 keeps the bias out of the model.
    bias_update_rate: float = 0.0
    # None: dropless. Else each expert keeps ceil(factor * tokens * top_k / num_experts) tokens.
    capacity_factor: float | None = None
    # Group-limited routing (DeepSeek-V3's n_group / topk_group): experts in num_expert_groups
    # contiguous groups; a token's top_k come from its topk_groups best groups (a group scores the
    # sum of its two best sigmoid scores, or its best softmax score). Under ep, where each rank's
    # block of experts is whole groups, topk_groups bounds how many ranks a token's experts are on.
    num_expert_groups: int = 1
    topk_groups: int = 1
    # The chosen experts' weights are multiplied by this after any renormalisation (DeepSeek-V3: 2.5).
    routed_scaling_factor: float = 1.0
    # Benchmarks only: token t's j-th choice is expert (t * top_k + j) mod num_experts, so every
    # expert gets the same load, as a trained router's near-balance gives. An untrained router on
    # synthetic tokens sends most tokens to a few experts, which under expert parallelism times the
    # imbalance rather than the model (Megatron's --moe-router-force-load-balancing and
    # TorchTitan's _debug_force_load_balance do the same). The weights are still the router's scores.
    force_load_balance: bool = False
    # Biases on the routed experts' gate, up and down projections, and on the router's logits (gpt-oss).
    expert_bias: bool = False
    router_logit_bias: bool = False
    # The routing weight multiplies the expert's input instead of its output (Llama 4's sigmoid top-1:
    # an expert sees its score times the token).
    scale_expert_inputs: bool = False
    # Which blocks are MoE, as one rule (`is_moe_layer`): block i is MoE iff i >= first_dense_layers,
    # (i + 1) % moe_layer_step == 0 and i is not in dense_layers; the others keep a dense SwiGLU of
    # width dense_ffn_dim. DeepSeekMoE/V3: first_dense_layers = first_k_dense_replace. Qwen3-MoE:
    # moe_layer_step = decoder_sparse_step, dense_layers = mlp_only_layers. Llama 4:
    # moe_layer_step = interleave_moe_layer_step (MoE on 1, 3, ... for 2). Any other pattern:
    # dense_layers lists the exceptions (`--model-overrides dense_layers=[0,5]`).
    first_dense_layers: int = 0
    dense_ffn_dim: int = 0
    moe_layer_step: int = 1
    dense_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # As LlamaConfig's.
    sliding_window: int | None = None
    explicit_head_dim: int | None = attrs.field(default=None, alias="head_dim")
    layer_pattern: str = ""
    attention_chunk: int | None = None
    qk_norm: bool = False
    attention_bias: bool = False
    attention_sinks: bool = False

    def __attrs_post_init__(self) -> None:
        _check_shape(self, ("dim", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
                            "num_experts", "top_k", "expert_ffn_dim"))
        if self.top_k > self.num_experts:
            raise UserError(f"top_k={self.top_k} is more than num_experts={self.num_experts}; "
                            f"choose top_k <= {self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise UserError(f"score_func={self.score_func!r} is unknown; choose one of {', '.join(SCORE_FUNCS)}")
        for name in ("num_shared_experts", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "first_dense_layers"):
            if getattr(self, name) < 0:
                raise UserError(f"model {name}={getattr(self, name)} must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise UserError(f"capacity_factor={self.capacity_factor} must be > 0, or None for dropless routing")
        _check_groups(self)
        if self.routed_scaling_factor <= 0:
            raise UserError(f"routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        _check_layer_rule(self)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has the routed experts (the rule of first_dense_layers,
        moe_layer_step and dense_layers), else a dense SwiGLU."""
        return (index >= self.first_dense_layers and (index + 1) % self.moe_layer_step == 0
                and index not in self.dense_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return layer_kinds(self)

    @property
    def has_selection_bias(self) -> bool:
        """Whether each MoE router carries the auxiliary-loss-free selection bias."""
        return self.bias_update_rate > 0

    @property
    def expert_glu(self) -> ClampedSwiGLU | None:
        """The experts' gated unit where it is not SwiGLU (None: SwiGLU)."""
        return None


def _check_layer_rule(cfg: MoEConfig) -> None:
    rule = (f"first_dense_layers={cfg.first_dense_layers}, moe_layer_step={cfg.moe_layer_step}, "
            f"dense_layers={list(cfg.dense_layers)}")
    if cfg.moe_layer_step < 1:
        raise UserError(f"moe_layer_step={cfg.moe_layer_step} must be >= 1 (every that-many-th block is MoE)")
    outside = [i for i in cfg.dense_layers if not 0 <= i < cfg.num_layers]
    if outside or len(set(cfg.dense_layers)) != len(cfg.dense_layers):
        raise UserError(f"dense_layers={list(cfg.dense_layers)} must list distinct blocks of 0 .. {cfg.num_layers - 1}")
    if not cfg.moe_layers:
        raise UserError(f"{rule} leaves no MoE layer out of num_layers={cfg.num_layers}; make a block MoE "
                        f"or use a dense model")
    if len(cfg.moe_layers) < cfg.num_layers and cfg.dense_ffn_dim < 1:
        raise UserError(f"{rule} makes dense blocks, which need dense_ffn_dim >= 1 (got {cfg.dense_ffn_dim})")


def _check_groups(cfg: MoEConfig) -> None:
    groups, chosen = cfg.num_expert_groups, cfg.topk_groups
    if groups < 1 or cfg.num_experts % groups:
        raise UserError(f"num_expert_groups={groups} must be >= 1 and divide num_experts={cfg.num_experts}")
    if groups == 1:
        return
    per_group = cfg.num_experts // groups
    if not 1 <= chosen <= groups:
        raise UserError(f"topk_groups={chosen} must be between 1 and num_expert_groups={groups}")
    if cfg.top_k > chosen * per_group:
        raise UserError(f"top_k={cfg.top_k} experts do not fit in topk_groups={chosen} groups of {per_group}; "
                        f"raise topk_groups or lower top_k")
    if cfg.score_func == "sigmoid" and per_group < 2:
        raise UserError(f"sigmoid routing scores a group by its two best experts, but {groups} groups of "
                        f"{cfg.num_experts} experts hold {per_group} each; use fewer groups")


@attrs.frozen
class DeepSeekConfig(MoEConfig):
    """DeepSeek-V2/V3: Multi-head Latent Attention in place of GQA, the MoE feed-forward, and
    optional multi-token prediction.

    MLA: queries come from x (or, with q_lora_rank > 0, from a normed rank-q_lora_rank latent of
    it); keys and values from a normed rank-kv_lora_rank latent shared by all heads. Each head's
    query and key are a qk_nope_head_dim part without position and a qk_rope_head_dim part with
    RoPE; the RoPE part of the key is one vector per token shared by all heads. Values have
    v_head_dim. Every head has its own key and value (num_kv_heads = num_heads).

    MTP (DeepSeek-V3): mtp_depth sequential modules; module k predicts the token k+1 ahead from
    the previous depth's hidden state and the embedding of the token k ahead, through one more
    transformer block, sharing the embedding and output head. Its loss joins the model's with
    weight mtp_loss_weight / mtp_depth per module."""

    q_lora_rank: int = 0  # 0: queries straight from x (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    norm_eps: float = 1e-6

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"model {name}={getattr(self, name)} must be >= 1")
        for name in ("q_lora_rank", "mtp_depth", "mtp_loss_weight"):
            if getattr(self, name) < 0:
                raise UserError(f"model {name}={getattr(self, name)} must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise UserError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.num_kv_heads != self.num_heads:
            raise UserError(f"MLA gives every head its own key and value: num_kv_heads={self.num_kv_heads} must "
                            f"equal num_heads={self.num_heads}")
        if self.explicit_head_dim is not None:
            raise UserError(f"head_dim={self.explicit_head_dim}: MLA's heads are qk_nope_head_dim + qk_rope_head_dim "
                            f"wide (values v_head_dim); set those instead")
        if self.qk_norm:
            raise UserError("qk_norm=true: MLA normalises its latents, not its heads; leave qk_norm false")
        if "nope" in self.layer_kinds:
            raise UserError(f"layer_pattern={self.layer_pattern!r} has NoPE layers, but MLA's keys carry RoPE; "
                            f"use full, window or chunk layers")
        for name in ("attention_bias", "attention_sinks"):
            if getattr(self, name):
                raise UserError(f"{name}=true: dtrain's MLA has neither attention biases nor sinks; set it false")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        return self.qk_head_dim

    @property
    def has_selection_bias(self) -> bool:
        # With sigmoid routing the bias is part of the model (DeepSeek-V3's checkpoints carry it),
        # also where bias_update_rate = 0 leaves it as it is.
        return self.score_func == "sigmoid" or self.bias_update_rate > 0
