"""Model FLOPs per token, the MFU numerator: 6 N + 12 L d S, N every matmul parameter but the input
embedding (the output head counts; of routed experts the active ones, top_k / num_experts), L
layers, d the model width, S the sequence length. MFU divides it by the dense BF16 peak (FP8 runs
too, so that the two compare)."""

from __future__ import annotations

import math

from models import families, masking, mixtral, spec
from models.config import DeepSeekConfig, LlamaConfig, MoEConfig, layer_kind


def _active_size(param: spec.ParamSpec, cfg: LlamaConfig | MoEConfig) -> int:
    """Elements of `param` one token uses: for stacked expert weights, its top_k experts' slices."""
    size = math.prod(param.shape)
    if isinstance(cfg, MoEConfig) and mixtral.is_expert_weight(param):
        return size // cfg.num_experts * cfg.top_k
    return size


def expert_share(cfg: LlamaConfig | MoEConfig) -> float:
    """The share of each routed expert weight one token runs through: top_k / num_experts."""
    return cfg.top_k / cfg.num_experts if isinstance(cfg, MoEConfig) else 1.0


def active_params(cfg: LlamaConfig | MoEConfig, *, with_mtp: bool = True) -> int:
    """Parameters one token uses, embeddings included (the "active" count MoE papers publish);
    `with_mtp=False` leaves the multi-token prediction modules out, as DeepSeek's totals do."""
    return sum(_active_size(p, cfg) for layer in families.layers(cfg) if with_mtp or layer.name != "mtp"
               for _, p in spec.flatten(layer.params))


def mtp_depth(cfg: LlamaConfig | MoEConfig) -> int:
    return cfg.mtp_depth if isinstance(cfg, DeepSeekConfig) else 0


def matmul_params(cfg: LlamaConfig | MoEConfig) -> int:
    """Parameters that take part in a matmul per token: every matrix (spec.is_matmul_weight) except the input
    embedding; the output head counts, also when it is tied to the embedding, and once more for
    each multi-token prediction module, which runs it on its own hidden states (their embedding
    lookups are not matmuls). For MoE only the active experts count; the router (a matmul over all
    experts) counts whole."""
    total = 0
    for layer in families.layers(cfg):
        if layer.name == "embed":
            continue
        total += sum(_active_size(s, cfg) for _, s in spec.flatten(layer.params) if spec.is_matmul_weight(s))
    head_uses_not_in_specs = int(cfg.tie_embeddings) + mtp_depth(cfg)
    return total + head_uses_not_in_specs * cfg.vocab_size * cfg.dim


def attention_flops_per_token(cfg: LlamaConfig | MoEConfig, keys: float) -> float:
    """Scores (q.k over the query/key head dims) and values (over the value head dims), forward and
    backward, against `keys` keys per query (the whole sequence S, causal or not, as the module's
    convention counts), in every attention layer: 6 S (qk + v)
    per layer, where qk and v are the summed head dims of all heads. For Llama qk = v = d
    (12 L d S), and heads x head_dim where the heads are not d / heads wide (Qwen3-0.6B); for MLA
    heads x (qk_nope + qk_rope) and heads x v_head_dim. MTP blocks attend too."""
    if isinstance(cfg, DeepSeekConfig):
        width = cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    else:
        width = 2 * cfg.num_heads * cfg.head_dim
    return 6.0 * keys * width * (cfg.num_layers + mtp_depth(cfg))


def convention_keys(cfg: LlamaConfig | MoEConfig, seq_len: int) -> float:
    """Keys per query in the MFU convention, the mean over the attention layers (MTP blocks too):
    the whole sequence S for full (and NoPE) layers, causal or not; the window or the chunk, where
    shorter than S, for windowed and chunked layers, which attend that many keys at most."""
    def keys(index: int) -> int:
        extent = masking.mask_extent(cfg, masking.mask_kind(layer_kind(cfg, index)))
        return min(seq_len, extent["window"] or seq_len, extent["chunk"] or seq_len)

    layers = range(cfg.num_layers + mtp_depth(cfg))
    return sum(map(keys, layers)) / len(layers)


def flops_per_token(cfg: LlamaConfig | MoEConfig, seq_len: int, attended_keys: float | None = None) -> float:
    """6 N (forward + backward matmuls) + the attention scores and values (12 L d S for Llama, causal
    or not: the module's convention; windowed and chunked layers by their window or chunk).
    With `attended_keys`, the mean number of keys a query attends to in a layer, the attention term
    counts those keys instead: the work actually needed, which for packed documents is the sum of
    their causal attention ((S + 1) / 2 keys for one causal document)."""
    keys = convention_keys(cfg, seq_len) if attended_keys is None else attended_keys
    return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, keys)
