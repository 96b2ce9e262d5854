"""The machine the models predict for: GPU memory, kernel rates and links.

Rates are measured on one H200 (torch 2.11, CUDA 13: an 8192^3 GEMM in BF16 and in FP8, a
device-to-device copy, NCCL's bus bandwidth), not datasheet figures, and the few that no
microbenchmark pins down (how fast attention and the element-wise kernels run in a whole step, how
much overlapped collectives slow compute) are fitted on the rows of benchmarks/results.jsonl
(`python -m dtrain.planner --validate`); each fitted rate's comment names the rows that set it (whose
predicted step moves most with it). Inter-node bandwidth is a setting: no row measures it.
"""

from __future__ import annotations

import math

import attrs

TERA = 1e12
GIGA = 1e9


@attrs.frozen
class Hardware:
    name: str = "h200"                   # the profile (gpus.py)
    gpu_memory_gb: float = 141.0         # what one GPU holds (H200: 141 GB; planners often assume 80)
    gpus_per_node: int = 8
    host_memory_gb: float = 2000.0       # per node, for CPU offload (the node's GPUs share it)
    peak_tflops: float = 989.0           # dense BF16 datasheet peak: the MFU denominator only
    fp8_peak_tflops: float = 1979.0      # dense FP8 datasheet peak (0: no FP8 matmuls)
    gemm_tflops: float = 780.0           # BF16 GEMM 8192^3, measured
    # GEMMs lose efficiency as their smaller weight dim shrinks: rate x n / (n + gemm_half_dim).
    # Fitted; set by the narrow experts of deepseek-v2-lite (7 layers, one GPU, seq 4096, 48e345c).
    gemm_half_dim: float = 80.0
    fp8_gemm_tflops: float = 1398.0      # FP8 e4m3 GEMM 8192^3 (torch._scaled_mm, tensorwise), measured
    # The experts' grouped GEMM in a whole step against a dense GEMM of the same weight shapes:
    # rate x efficiency x rows / (rows + half_rows), with `rows` per expert (fewer rows read each
    # expert's weights for fewer FLOPs). half_rows is fitted on the two torch bf16 grouped_mm rows of
    # benchmarks/experts.jsonl (mixtral-small: 2,048 rows per expert, 558 TFLOP/s; deepseek-v2-lite:
    # 768 rows, 430 TFLOP/s); the efficiency on the whole-step mixtral-small rows of
    # benchmarks/results.jsonl (0.65 of a dense GEMM at their 2,048 rows per expert).
    grouped_gemm_efficiency: float = 0.78
    grouped_gemm_half_rows: float = 406.0
    # torchao's FP8 rowwise grouped GEMM (--fp8-experts) the same way from the FP8 GEMM rate. Its
    # rows per expert to reach half of it are a prior, twice the bf16 kernel's (FP8 tiles are larger,
    # so small groups leave more of them idle); its efficiency is fitted on the whole-step
    # mixtral-small row of benchmarks/results.jsonl (8 layers, micro-batch 2 of 16, balanced routing,
    # dfada40: 53,104 tokens/s against 70,280 with bf16 experts in the same call, both with the
    # graph break at attention that 2a34cef removed): at that shape the casts and the kernel's own
    # overheads cost more than the FP8 rate saves.
    fp8_grouped_gemm_efficiency: float = 0.47
    fp8_grouped_gemm_half_rows: float = 812.0
    # Bytes the FP8 experts' casts move: per element of a GEMM's input and output widths and row,
    # as a dense FP8 matmul's dynamic casts (kernels.FP8_CAST_BYTES); per weight element and
    # micro-batch, two casts of each expert's weight (per output column for the forward, per
    # input column for the input gradient), each an amax read, a read and a one-byte write.
    fp8_expert_row_cast_bytes: float = 14.0
    fp8_expert_weight_cast_bytes: float = 10.0
    # Causal cuDNN attention, fwd+bwd, at long sequences in a whole step (fitted; set by llama-1b at
    # seq 32768 and 65536 on one GPU, and at seq 131072 over cp=2 ring, 8bd94c4 and d5e057e).
    attention_tflops: float = 355.0
    # Attention over short key ranges runs slower: rate x s / (s + attention_half_seq) (fitted; set
    # by llama-1b's 4096-token sliding window at seq 32768 and llama-3b within documents of 2048
    # tokens at seq 8192, 030e263).
    attention_half_seq: float = 3400.0
    hbm_tb_s: float = 4.23               # device-to-device copy, measured
    # Element-wise and norm kernels of a block (forward and backward) move this many times the
    # bytes a block saves for its backward (fitted; set by mixtral-small dp=2,ep=2 with the
    # all-gather dispatch, 64a0ae9 and ad33144, and llama-1b on one GPU with selective recompute, a94440d).
    elementwise_traffic: float = 1.0
    nvlink_gb_s: float = 350.0           # NCCL bus bandwidth per GPU inside a node
    inter_node_gb_s: float = 50.0        # per GPU across nodes (400 Gb/s InfiniBand per GPU)
    # Compute slows by this fraction of the time collectives overlap with it (their kernels take SMs;
    # fitted; set by mixtral-small dp=2 with and without --fsdp-reduce-once, 3dc4650, and llama-8b
    # dp=2 at seq 8192, 5acb6e7).
    overlap_slowdown: float = 0.7
    collective_latency_s: float = 100e-6  # per collective call
    # Each tp collective of a block costs this much beyond its transfer: the copies into and out
    # of its buffers and the layout changes around it (fitted on the tp=2 rows: llama-1b tp=2 SP at
    # seq 4096, 5acb6e7, and llama-8b tp=2 SP at seq 8192, 64a0ae9).
    tp_region_s: float = 0.0003
    host_gb_s: float = 25.0              # host <-> GPU copies (CPU offload)
    # AdamW on the CPU, bytes of state touched per second (fitted: llama-8b dp=2 --cpu-offload on a
    # host of 32 cores and 2 H200s, 1,066 tokens/s/GPU).
    cpu_adam_gb_s: float = 23.0
    # Ring attention within documents or a window attends each block with the masked kernels and
    # merges the blocks' partial results: this many times the fused kernel's time (fitted on the
    # llama-1b cp=2 ring row with documents; all-gather and all-to-all CP attend whole rows).
    masked_ring_slowdown: float = 1.75
    # Launches and host work per step that nothing hides (fitted; no row's step moves by more than
    # 0.1% with it: the single-GPU mixtral-small rows of 9bdcf97 move most).
    step_overhead_s: float = 0.0005
    # GPipe and looped BFS (every forward before any backward) ran each micro-batch this much
    # slower than 1F1B and interleaved 1F1B on 2 H200s (llama-1b pp=2 at seq 4096, gpipe and
    # looped-bfs with 8 and 16 micro-batches, 8bd94c4: the README's bubble table).
    breadth_first_slowdown: float = 0.15
    # Launches and host work per micro-batch of a rank, however many pipeline stages it holds
    # (fitted on the same llama-1b pp=2 rows, 8bd94c4 and 75c3da5; their interleaved 1F1B and
    # looped BFS rows, two stages per rank, cost no more per micro-batch than 1F1B's one).
    micro_batch_overhead_s: float = 0.0037

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gb * GIGA

    @property
    def host_bytes_per_gpu(self) -> float:
        return self.host_memory_gb * GIGA / self.gpus_per_node

    def exchange_seconds(self, nbytes: float, group: int, stride: int) -> float:
        """An exchange in which each of `group` ranks, `stride` apart, sends `nbytes` spread evenly
        over the group (itself included, which costs nothing): the share for ranks of its node
        over NVLink and the rest over the network, at the same time."""
        in_node = max(1, min(group, self.gpus_per_node // stride))
        inside = nbytes * (in_node - 1) / group / (self.nvlink_gb_s * GIGA)
        outside = nbytes * (group - in_node) / group / (self.inter_node_gb_s * GIGA)
        return max(inside, outside)

    def expert_matmul_seconds(self, shape: tuple[int, ...], routed_rows: float, rows_per_expert: float,
                              fp8: bool) -> tuple[float, float]:
        """(GEMM, casts) seconds of one routed-expert weight of `shape` ([experts, out, in] on the
        rank) over `routed_rows` rows, `rows_per_expert` each, forward and backward: the grouped
        GEMM at the bf16 or FP8 rate, and FP8's casts of the rows and of every expert's weight."""
        smaller = min(shape[-2:])
        flops = 6 * math.prod(shape[-2:]) * routed_rows
        if fp8:
            rate, efficiency, half_rows = self.fp8_gemm_tflops, self.fp8_grouped_gemm_efficiency, \
                self.fp8_grouped_gemm_half_rows
            cast_bytes = (self.fp8_expert_row_cast_bytes * sum(shape[-2:]) * routed_rows
                          + self.fp8_expert_weight_cast_bytes * math.prod(shape))
        else:
            rate, efficiency, half_rows = self.gemm_tflops, self.grouped_gemm_efficiency, self.grouped_gemm_half_rows
            cast_bytes = 0.0
        rate *= smaller / (smaller + self.gemm_half_dim) * efficiency * rows_per_expert / (rows_per_expert + half_rows)
        return flops / (rate * TERA), cast_bytes / (self.hbm_tb_s * TERA)

    def fp8_experts_gain(self, num_experts: int, dim: int, expert_ffn_dim: int, rows_per_expert: float) -> float:
        """How many times faster routed experts' GEMMs (with their casts) run in FP8 than in bf16 at
        `rows_per_expert` rows for each expert: below 1 where FP8 experts do not pay."""
        shape, rows = (num_experts, expert_ffn_dim, dim), rows_per_expert * num_experts
        return (sum(self.expert_matmul_seconds(shape, rows, rows_per_expert, fp8=False))
                / sum(self.expert_matmul_seconds(shape, rows, rows_per_expert, fp8=True)))

    def link_gb_s(self, group_span: int) -> float:
        """Bus bandwidth per GPU of a collective over `group_span` consecutive ranks (the group's
        stride times its size): NVLink inside a node, the network across nodes."""
        return self.nvlink_gb_s if group_span <= self.gpus_per_node else self.inter_node_gb_s


H200 = Hardware()
