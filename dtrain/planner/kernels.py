"""Seconds of the kernels of one block (or the head) on a rank, forward and backward, for one
micro-batch: its matmuls at the measured GEMM rates (slower for narrow weights, the routed experts'
grouped GEMM slower for fewer rows per expert), FP8's casts at HBM bandwidth, causal attention at
the rate fitted on whole steps (slower over short key ranges), and the output projection with its
loss. steptime.py adds them up with the collectives, the bubble and the optimizer.

    from dtrain.planner import kernels
    gemm, casts = kernels.gemm_seconds(work, block, hardware)    # work: dtrain.planner.workload.Workload
"""

from __future__ import annotations

import math

from dtrain.planner.activations import DTYPE_BYTES
from dtrain.planner.hardware import TERA, Hardware
from dtrain.planner.workload import Workload
from models.config import MoEConfig
from parallel import precision

# Bytes moved per element of an FP8 matmul's input and output widths and per token by its casts,
# forward and backward. Dynamic scaling (torchao's recipes, TE's current and blockwise) reads each
# bf16 tensor once for its amax before it casts it: fitted at 14 on the torchao tensorwise rows of
# benchmarks/results.jsonl (llama-1b and llama-8b) and kept by TE current's and blockwise's
# llama-1b rows. A recipe whose scale is known when it casts (TE delayed, from the amax history;
# MXFP8, per 32-element block inside the cast kernel) skips that read of the three tensors each
# matmul casts (its input, the input again for the weight gradient, the output's gradient), 2 bytes
# each: 8 (TE delayed's llama-1b and mixtral-small rows agree within 3%).
FP8_CAST_BYTES = {"tensorwise": 14.0, "rowwise": 14.0, "rowwise_with_gw_hp": 14.0, "current": 14.0,
                  "blockwise": 14.0, "delayed": 8.0, "mxfp8": 8.0}


def gemm_seconds(work: Workload, block: int, hw: Hardware) -> tuple[float, float]:
    """The block's matmuls (forward and backward: 6 FLOPs per weight element and row) with the
    weights' shapes on this rank, and the casts of FP8 matmuls' inputs; routed experts see top_k
    rows per token of the tp rank's share."""
    fp8, t = block in work.fp8_blocks, work.config.train
    gemm = casts = 0.0
    for shape, is_expert, axes in work.weights_by_kind[work.block_kinds[block]]:
        flops = 6 * math.prod(shape[-2:]) * work.tokens
        smaller = min(shape[-2:])
        rate = hw.gemm_tflops * smaller / (smaller + hw.gemm_half_dim)
        if is_expert:
            routed_rows = work.tokens / work.mesh_spec.tp * work.model_cfg.top_k
            expert_gemm, expert_casts = hw.expert_matmul_seconds(shape, routed_rows, expert_rows(work),
                                                                 fp8=block in work.fp8_expert_blocks)
            gemm, casts = gemm + expert_gemm, casts + expert_casts
            continue
        if fp8 and precision.is_fp8_matmul_weight(axes):
            rate = hw.fp8_gemm_tflops * smaller / (smaller + hw.gemm_half_dim)
            # Dynamic scaling reads each input and output gradient for its amax and writes its casts.
            casts += FP8_CAST_BYTES[t.fp8] * sum(shape[-2:]) * work.tokens / (hw.hbm_tb_s * TERA)
        gemm += flops / (rate * TERA)
    return gemm, casts


def expert_rows(work: Workload) -> float:
    """Rows each local expert runs per micro-batch under balanced routing: the top_k slots of the
    tokens of the ep ranks that send to it (each tp rank's share)."""
    cfg: MoEConfig = work.model_cfg
    return work.tokens / work.mesh_spec.tp * cfg.top_k * work.mesh_spec.ep / cfg.num_experts


def attention_seconds(work: Workload, block: int, hw: Hardware) -> float:
    """Causal attention of `block`: forward 4 FLOPs per query, key and query width over the keys
    before each query (S/2 on average; fewer in windowed and chunked layers, whose kernels skip the
    blocks outside), backward twice that (the MFU convention's 12 L d S, models/flops.py, halved);
    slower over short keys (the all-gather's and the ring's context-parallel blocks are a rank's
    S / cp long, while a2a attends whole rows over its heads; windows, chunks and documents as long
    as they are)."""
    d, mesh = work.config.data, work.mesh_spec
    documents = d.synthetic_document_length if d.document_mask else 0
    window, chunk = work.attention_extent(block)["window"], work.attention_extent(block)["chunk"]
    q_width = math.ceil(work.model_cfg.num_heads / mesh.tp) * work.model_cfg.head_dim
    flops = 12 * work.tokens * mean_keys(d.seq_len, window, documents, chunk) * q_width
    row = d.seq_len if work.config.parallel.cp_comm == "a2a" else d.seq_len / mesh.cp
    keys = min(row, window or d.seq_len, chunk or d.seq_len, documents or d.seq_len)
    rate = hw.attention_tflops * keys / (keys + hw.attention_half_seq)
    return flops / (rate * TERA)


def mean_keys(seq_len: int, window: int | None, document_length: int = 0, chunk: int | None = None) -> float:
    """Keys a causal query attends to on average: (S + 1) / 2, or fewer under a sliding window
    (the kernels skip the blocks outside it), within chunks of absolute positions (a query sees
    its chunk's keys up to itself), or within packed documents of random lengths with mean
    `document_length` (the synthetic data's: each token starts a new document with probability
    1 / mean, so a query sees min(its document's age, its position) + 1 keys); with several, the
    fewest."""
    if window is None or window >= seq_len:
        causal = (seq_len + 1) / 2
    else:
        causal = (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
    if chunk is not None and chunk < seq_len:
        whole, rest = divmod(seq_len, chunk)
        causal = min(causal, (whole * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2) / seq_len)
    if not document_length:
        return causal
    stay = 1 - 1 / document_length  # a token continues its document
    within = 1 + stay * document_length * (1 - (1 - stay ** seq_len) / (seq_len / document_length))
    return min(causal, within)


def head_seconds(work: Workload, hw: Hardware) -> float:
    """Output projection and cross-entropy: the logits are read and written a few times (fused
    with the loss on one tp rank, or a chunk of tokens at a time; fp32 log-probabilities under tp
    or without compile). Chunked, each chunk's share of the weight gradient is also added to an
    fp32 sum."""
    cfg, mesh, t = work.model_cfg, work.mesh_spec, work.config.train
    vocab = math.ceil(cfg.vocab_size / mesh.tp)
    gemm, casts = head_gemm_seconds(work, hw)
    b = DTYPE_BYTES[t.precision]
    fused = t.compile and (mesh.tp == 1 or t.loss_chunk_tokens > 0)
    moved = work.tokens * vocab * (4 * b if fused else 24)
    chunk = loss_chunk(work)
    if chunk:
        # Each later chunk's weight-gradient GEMM output, read with the fp32 sum, which is written.
        moved += (math.ceil(work.tokens / chunk) - 1) * vocab * cfg.dim * (b + 8)
    return gemm + casts + moved / (hw.hbm_tb_s * TERA)


def head_gemm_seconds(work: Workload, hw: Hardware) -> tuple[float, float]:
    """The output projection's matmuls on this rank's vocab shard (as small as a loss chunk), and
    its FP8 casts (--fp8-head)."""
    cfg, t = work.model_cfg, work.config.train
    vocab = math.ceil(cfg.vocab_size / work.mesh_spec.tp)
    smaller = min(vocab, cfg.dim, loss_chunk(work) or vocab)
    fp8 = t.fp8 is not None and t.fp8_head
    rate = (hw.fp8_gemm_tflops if fp8 else hw.gemm_tflops) * smaller / (smaller + hw.gemm_half_dim)
    casts = FP8_CAST_BYTES[t.fp8] * (vocab + cfg.dim) * work.tokens / (hw.hbm_tb_s * TERA) if fp8 else 0.0
    return 6 * work.tokens * vocab * cfg.dim / (rate * TERA), casts


def loss_chunk(work: Workload) -> int | None:
    """Tokens per chunk of the head under --loss-chunk-tokens (None: unfused)."""
    chunk = work.config.train.loss_chunk_tokens
    return min(chunk, work.tokens) if chunk else None
