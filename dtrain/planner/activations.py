"""Bytes that autograd keeps from a block's forward until its backward, per micro-batch on one rank.

Each term names a tensor the backward reads. The lists follow what autograd saves for dtrain's
blocks (tests/unit/test_memory_model.py counts them on the CPU through saved-tensor hooks): compiled
blocks save the matmul and attention inputs and recompute norms and RoPE; selective recompute
keeps only the outputs of matmuls, attention and collectives; full recompute keeps the block
input and recomputes the rest, one block at a time, in backward.

Widths per rank follow the plan: heads and the MLP split over tp, the residual stream split over
tp along the sequence under sequence parallelism, the tokens over cp; MoE layers run each tp
rank's share of the tokens, and their rows are the routed slots (top_k per token).
"""

from __future__ import annotations

import math

import attrs

from dtrain.planner.workload import Workload
from models.config import MoEConfig

DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@attrs.frozen(cache_hash=True)
class KernelFacts:
    """How the attention kernel lays out what it saves, which differs by device and compilation."""

    # The attention output saved in the kernel's layout and again, made contiguous, as the output
    # projection's input: 2 where the kernel writes heads-major (the CPU's flash kernel), else 1.
    output_copies: int = 1
    # Under GQA, K/V repeated to the query heads before the kernel (and saved so): eager SDPA
    # takes this path where the kernel has no GQA of its own.
    eager_expands_kv: bool = True
    # What the CUDA kernels keep beyond the tensors above (cuDNN's saved workspace and RNG
    # state), in units of one attention output (bytes of q): 0.7 on CUDA (`CUDA` below), fitted on
    # the compiled H200 rows of benchmarks/results.jsonl; set most by llama-8b dp=2 at seq 8192 with
    # --cpu-offload (5acb6e7) and llama-1b pp=2 under gpipe and looped-bfs (8bd94c4).
    extra_outputs: float = 0.0


CUDA = KernelFacts(output_copies=1, eager_expands_kv=True, extra_outputs=0.7)
CPU = KernelFacts(output_copies=2, eager_expands_kv=False, extra_outputs=0.0)


def kernel_facts(layout) -> KernelFacts:
    """The attention kernel's facts on the machine a layout was resolved for: SDPA's cuDNN or flash
    kernels on CUDA, its flash kernel for the CPU there."""
    return CPU if layout.machine.device_type == "cpu" else CUDA


def _widths(work: Workload) -> tuple[int, int, int, int, int]:
    """Per tp rank: model dim, residual width per token (d/tp under SP), query width, K/V width,
    local query heads."""
    cfg, tp = work.model_cfg, work.mesh_spec.tp
    d, hd = cfg.dim, cfg.head_dim
    residual = d / tp if work.plan.sequence_parallel else d
    heads = math.ceil(cfg.num_heads / tp)
    kv_heads = math.ceil(cfg.num_kv_heads / tp) if cfg.num_kv_heads >= tp else cfg.num_kv_heads
    return d, residual, heads * hd, kv_heads * hd, heads


def block_bytes(work: Workload, block: int, mode: str, kernel: KernelFacts | None = None) -> float:
    """Saved bytes of one micro-batch of `block` on this rank under recompute `mode`."""
    kernel = kernel or kernel_facts(work.layout)
    t, p = work.config.train, work.config.parallel
    key = ("saved", work.block_kinds[block], work.attention_kinds[block], _saves_float8(work, block), mode, kernel,
           work.tokens, t.precision, t.compile, t.fuse_projections, p.cp_comm)
    if key not in work.memo:
        work.memo[key] = _block_bytes(work, block, mode, kernel)
    return work.memo[key]


def _saves_float8(work: Workload, block: int) -> bool:
    """torchao's FP8 matmuls keep float8 casts for the backward; Transformer Engine's
    (`dtrain::te_linear`) keep the bf16 input and weight and quantize them again in the backward,
    so a TE block saves what a bf16 block saves."""
    return block in work.fp8_blocks and work.config.train.fp8_backend != "te"


def _block_bytes(work: Workload, block: int, mode: str, kernel: KernelFacts) -> float:
    b = DTYPE_BYTES[work.config.train.precision]
    d, residual, q_width, kv_width, heads = _widths(work)
    if mode == "full":
        return work.tokens * b * residual
    compiled = work.config.train.compile
    fp8 = _saves_float8(work, block)
    attention = _attention_per_token(work, mode, compiled, fp8, kernel, b, d, residual, q_width, kv_width, heads)
    total = work.tokens * (b * residual + attention)
    if mode == "none":
        total += work.tokens * _head_norms_per_token(work, block, compiled, b, q_width, kv_width)
    if work.is_moe(block):
        total += work.tokens / work.mesh_spec.tp * _moe_per_token(work, mode, compiled, b)
    else:
        ffn = work.model_cfg.dense_ffn_dim if isinstance(work.model_cfg, MoEConfig) else work.model_cfg.ffn_dim
        total += work.tokens * _mlp_per_token(work, mode, compiled, fp8, b, d, residual, math.ceil(ffn / work.mesh_spec.tp))
    if work.is_mtp(block):
        # Each MTP module also keeps its two normed inputs and their concatenation for its projection.
        total = work.repeats(block) * (total + work.tokens * b * 4 * d)
    matmul_weights = work.block_units(block)[0].matmul
    if fp8 and not work.float8_all_gather:
        # Each FP8 matmul keeps its float8 weight cast for the backward, per micro-batch.
        total += matmul_weights
    # Fused only where the weights are plain tensors on the rank: not split by tp, not gathered in float8.
    plain_weights = work.mesh_spec.tp == 1 and not (fp8 and work.float8_all_gather)
    if work.config.train.fuse_projections and plain_weights and mode == "none":
        if fp8:
            # One FP8 matmul over the concatenated weights keeps that bf16 concatenation.
            total += 2 * matmul_weights
        elif compiled:
            # The fused q/k/v output stays whole (V is a view of it) beside the rotated Q and K.
            total += work.tokens * b * (q_width + kv_width)
    return total


def _collective_outputs(work: Workload, b: int, d: int) -> float:
    """Selective recompute keeps the outputs of tp's collectives: per region, the all-reduce of a
    row-parallel output, or under SP the all-gather into it and the reduce-scatter out of it."""
    tp = work.mesh_spec.tp
    if tp == 1:
        return 0.0
    return b * (d + d / tp) if work.plan.sequence_parallel else b * d


def _attention_per_token(work, mode, compiled, fp8, kernel, b, d, residual, q_width, kv_width, heads) -> float:
    lse = 4 * heads
    kv_saved = q_width if (kernel.eager_expands_kv and not compiled) else kv_width
    if work.mesh_spec.cp > 1 and work.config.parallel.cp_comm == "allgather":
        # The gathered K/V of the whole sequence, kept for the backward of every query chunk.
        kv_width = kv_saved = kv_width * work.mesh_spec.cp
    out = q_width * (kernel.output_copies + kernel.extra_outputs)
    gathered_input = d if work.plan.sequence_parallel else 0.0  # SP: the norm's output, gathered over tp
    if mode == "selective":
        return b * (q_width + 2 * kv_width + out) + lse + _collective_outputs(work, b, d)
    if not compiled:
        # The norm keeps its fp32 input and its output; SDPA its inputs and output; the output
        # projection the output made contiguous.
        norm = 4 * residual + b * residual + b * gathered_input
        return norm + b * (q_width + 2 * kv_saved + q_width * max(kernel.output_copies, 2)) + lse
    if fp8:
        # The float8 casts of the matmul inputs are recomputed from the residual after attention.
        return b * (2 * q_width + 2 * kv_width + residual) + lse
    return b * (d + q_width + 2 * kv_width + out) + lse + 8


def _head_norms_per_token(work: Workload, block: int, compiled: bool, b: int, q_width: int, kv_width: int) -> float:
    """Each query and key head RMS-normed (Qwen3's qk-norm before RoPE, Llama 4's weightless norm
    after it, not in NoPE layers): eager keeps the fp32 input of each norm (and qk-norm its output
    for the weight's gradient), compiled the input in the compute dtype; both the statistics."""
    cfg = work.model_cfg
    weighted = getattr(cfg, "qk_norm", False)
    weightless = getattr(cfg, "qk_l2_norm", False) and work.attention_kinds[block] != "nope"
    heads = (q_width + kv_width) / cfg.head_dim
    per_norm = (b if compiled else 4 + (b if weighted else 0)) * (q_width + kv_width) + 4 * heads
    return (weighted + weightless) * per_norm


def _mlp_per_token(work, mode, compiled, fp8, b, d, residual, ffn) -> float:
    gathered_input = d if work.plan.sequence_parallel else 0.0
    if mode == "selective":
        return b * 2 * ffn + _collective_outputs(work, b, d)
    if not compiled:
        return 4 * residual + b * residual + b * gathered_input + b * 4 * ffn
    if fp8:
        return b * 2 * ffn
    return b * (d + 3 * ffn)


def _moe_per_token(work: Workload, mode: str, compiled: bool, b: int) -> float:
    """Per token of a tp rank's share: the router in fp32, the routed rows (top_k per token,
    ep times as many under the all-gather dispatch, which runs on every rank's slots), their
    SwiGLU, and the shared experts."""
    cfg: MoEConfig = work.model_cfg
    d, k, f, experts = cfg.dim, cfg.top_k, cfg.expert_ffn_dim, cfg.num_experts
    rows = k * (work.mesh_spec.ep if work.ep_dispatch == "allgather" else 1)
    shared = cfg.num_shared_experts * f
    router = 4 * experts + 8 * 3 * k
    if mode == "selective":
        exchanged = 2 * b * k * d if work.ep_dispatch == "alltoall" else 0.0
        return router + b * rows * (2 * f + d) + exchanged + b * 2 * shared
    if not compiled:
        # Eager, per token: the norm's fp32 input, its output before the weight (the weight's
        # gradient reads it) and its statistic; the router's fp32 input (its gradient reads it), its
        # fp32 logits (the z-loss's logsumexp keeps them and its result) and probabilities, and the
        # renormalization's sum and clamp; and the router's weight in fp32, once per block.
        norm = 4 * d + b * d + 4
        routing = 4 * d + 8 * experts + 4 + 8 + 4 * experts * d / (work.tokens / work.mesh_spec.tp)
        # Per slot: the top-k expert id (the weights' gather keeps it), the gathered weight and the
        # renormalized one, the slot's token (the rows' gather) and the slot's row (the combine's
        # gather); under the all-to-all, two more int64 positions of each received row (into
        # expert order and back).
        per_slot = 8 + 4 + 4 + 8 + 8 + (16 if work.ep_dispatch == "alltoall" else 0)
        # Per routed row: its input (the gate and up GEMMs keep it), the SwiGLU's gate, up, activated
        # gate and product (gpt-oss's clamped unit keeps the clamps' inputs and one more product: 7,
        # not 4), and the expert's output in fp32, which the routing weight multiplies; where the
        # weight scales the input instead (Llama 4), the input before that product, and no fp32 row.
        unit = 7 if cfg.expert_glu is not None else 4
        per_row = b * d + unit * b * f + (b * d if cfg.scale_expert_inputs else 4 * d)
        return norm + routing + k * per_slot + rows * per_row + (b * (d + 4 * shared) if shared else 0.0)
    return 4 * d + router + b * rows * (2 * d + 3 * f) + (b * (d + 3 * shared) if shared else 0.0)


def recompute_peak_bytes(work: Workload, block: int, kernel: KernelFacts | None = None) -> float:
    """Under full recompute, one block's activations exist again while its backward runs."""
    return block_bytes(work, block, "none", kernel)


def head_bytes(work: Workload) -> tuple[float, float]:
    """The head's saved bytes for one micro-batch, and what its forward or backward adds on top.

    Compiled, the loss fuses into the head's graph (under tp too: the vocab-parallel loss is two
    all-reduces of one number per token, parallel/tensor_parallel.py): it keeps its input, the
    normed input and the logits (its vocab shard) in the compute dtype, and writes their gradient in
    place (under tp, in fp32 first). Eager cross-entropy never fuses: it keeps fp32
    log-probabilities and makes an fp32 gradient and its cast. An FP8 head also makes two float8 casts of the logits' gradient for its
    two GEMMs. The chunked loss (--loss-chunk-tokens) is `chunked_head_bytes`. Each multi-token
    prediction module runs the head once more and keeps as much again."""
    saved, extra = chunked_head_bytes(work) if work.config.train.loss_chunk_tokens else _head_bytes(work)
    return saved * (1 + work.mtp_depth), extra


def _head_bytes(work: Workload) -> tuple[float, float]:
    cfg, t, tp = work.model_cfg, work.config.train, work.mesh_spec.tp
    b = DTYPE_BYTES[t.precision]
    d, residual, *_ = _widths(work)
    vocab = math.ceil(cfg.vocab_size / tp)
    tokens = work.tokens
    fp8_gradient = 2 * tokens * vocab if t.fp8 is not None and t.fp8_head else 0.0
    if t.compile:
        # Under tp the logits' gradient is made in fp32 across the all-reduces before its cast.
        return tokens * (b * (residual + d + vocab) + 4), (4 * tokens * vocab if tp > 1 else 0.0) + fp8_gradient
    saved = tokens * (b * residual + b * d + 4 * vocab + 4)
    return saved, tokens * (4 + b) * vocab + fp8_gradient


def chunked_head_bytes(work: Workload) -> tuple[float, float]:
    """The head under --loss-chunk-tokens (models/linear_cross_entropy.py): its forward makes the
    gradients and keeps them, the input's in the compute dtype and the weight's (its vocab shard)
    in fp32, beside what the norm keeps (its input, in fp32 in eager beside its output, and its
    statistics). On top, the larger of the forward's chunk (its logits and their gradient, and in
    eager the fp32 copy of narrower logits that becomes the gradient before its cast; and one
    chunk's share of the weight gradient before it joins the fp32 sum) and the backward's scaled
    gradients."""
    cfg, t = work.model_cfg, work.config.train
    b = DTYPE_BYTES[t.precision]
    d, residual, *_ = _widths(work)
    vocab = math.ceil(cfg.vocab_size / work.mesh_spec.tp)
    tokens, chunk = work.tokens, min(t.loss_chunk_tokens, work.tokens)
    norm = b * residual if t.compile else 4 * residual + b * residual
    saved = tokens * (norm + b * d + 4) + 4 * vocab * d
    forward = chunk * vocab * (2 * b if t.compile or b == 4 else 2 * b + 4) + b * vocab * d
    backward = b * (vocab * d + tokens * d)
    return saved, max(forward, backward)


def stage_output_bytes(work: Workload) -> float:
    """A pipeline stage keeps its output for each micro-batch in flight, until its gradient comes."""
    b = DTYPE_BYTES[work.config.train.precision]
    return work.tokens * b * _widths(work)[1]
