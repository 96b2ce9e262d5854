"""The step-time model: seconds per optimizer step, tokens/s per GPU and MFU of a configuration.

    from dtrain.planner.steptime import predict_step
    step = predict_step(layout)        # layout: dtrain.layout.resolve(config, 1024, machine); H200 unless given
    step.seconds, step.tokens_per_sec_per_gpu, step.mfu

Per micro-batch and block on a rank: the GEMMs of its weights (their shapes after the plan's
split, in BF16 or FP8) at measured GEMM rates, causal attention (both: kernels.py), and
element-wise kernels at device-copy bandwidth in proportion to the bytes the block saves
(activations.py). Collectives
cross the link their group spans (NVLink inside a node, the network across nodes): tensor,
context and expert parallelism's collectives wait for their data; FSDP's all-gathers and
reduce-scatters overlap the compute and cost what they do not hide, and slow the compute they
overlap. A pipeline adds its schedule's bubble; the optimizer step reads and writes the rank's
fp32 state once (FSDP's and the optimizer's share: fsdp_time.py). A model's multi-token
prediction layer runs on the last stage: its modules' blocks, and the head once more for each.

`ceiling(layout)` is the same step with only its GEMMs and attention: the bound that
`python -m tools.bench --profile` sets each measured step's breakdown beside.
"""

from __future__ import annotations

import functools
import math

import attrs

from dtrain.layout import RunLayout
from dtrain.planner import activations, kernels
from dtrain.planner.activations import DTYPE_BYTES
from dtrain.planner.fsdp_time import fsdp_exposed_seconds, optimizer_seconds
from dtrain.planner.hardware import GIGA, H200, TERA, Hardware
from dtrain.planner.workload import Stage, Workload, workload
from models import flops
from models.config import MoEConfig
from parallel import pipeline

# How many times a block's forward and backward run their matmuls and element-wise kernels, per
# recompute mode: full recompute runs the forward (a third of the matmuls) and its element-wise
# kernels again; selective keeps the matmuls' outputs and recomputes the element-wise kernels.
MATMULS_RUN = {"none": 1.0, "selective": 1.0, "full": 4 / 3}
ELEMENTWISE_RUN = {"none": 1.0, "selective": 4 / 3, "full": 1.5}


@attrs.frozen
class _Throughput:
    """Tokens/s per GPU and MFU of a step of `seconds` (the subclass's) over `tokens` on
    `world_size` ranks."""

    tokens: int             # per step, all ranks
    world_size: int
    flops_per_token: float
    # The GPU's dense BF16 peak (TFLOP/s), the MFU denominator.
    peak_tflops: float = attrs.field(default=H200.peak_tflops, kw_only=True)

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.tokens / self.seconds / self.world_size

    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the dense BF16 peak (FP8 runs too),
        as a fraction."""
        return self.flops_per_token * self.tokens_per_sec_per_gpu / (self.peak_tflops * TERA)


@attrs.frozen
class StepTime(_Throughput):
    """Seconds of one optimizer step on the slowest rank, by what they are spent on."""

    compute: float          # GEMMs, attention, element-wise kernels (recompute included)
    # Collectives waited for, per mesh dim: tp, cp and ep's, and the pipeline's sends ("pp").
    waits: dict[str, float]
    # The data-parallel collectives' exposed seconds, per kind ("dp_all_gather", "dp_reduce_scatter",
    # "dp_replicate_all_reduce"): what compute does not hide, and the slowdown of what it hides.
    data_parallel: dict[str, float]
    bubble: float           # pipeline fill and drain
    optimizer: float        # the AdamW step (on the CPU under --cpu-offload)
    offload: float          # --cpu-offload's copies between host and GPU
    overhead: float

    @property
    def communication(self) -> float:
        return sum(self.waits.values())

    @property
    def fsdp_exposed(self) -> float:
        return sum(self.data_parallel.values())

    @property
    def seconds(self) -> float:
        return (self.compute + self.communication + self.fsdp_exposed + self.bubble + self.optimizer + self.offload
                + self.overhead)

    def breakdown(self) -> dict[str, float]:
        """Seconds per part of the step: compute, each wait and exposed collective, the bubble,
        the optimizer, offload's copies and the fixed overhead (the parts that take time)."""
        parts = {"compute": self.compute, **self.waits, **self.data_parallel, "bubble": self.bubble,
                 "optimizer": self.optimizer, "offload": self.offload, "overhead": self.overhead}
        return {name: round(seconds, 4) for name, seconds in parts.items() if seconds > 0}

    def bound_by(self, at_least: float = 0.02) -> str:
        """What beyond compute takes the step's time, largest first, as shares of the step (those
        of at least `at_least`): "pp bubble 18%, dp all-gather exposed 6%"."""
        shares = sorted(((seconds / self.seconds, name) for name, seconds in self.breakdown().items()
                         if name not in ("compute", "overhead")), reverse=True)
        named = [f"{BOUND_NAMES.get(name, name)} {100 * share:.0f}%" for share, name in shares if share >= at_least]
        return ", ".join(named) or f"compute {100 * self.compute / self.seconds:.0f}%"

    def as_dict(self) -> dict[str, float]:
        return self.breakdown() | {"seconds": round(self.seconds, 4)}


# How the bound-by line names each part of a step.
BOUND_NAMES = {"tp": "tp collectives", "cp": "cp collectives", "ep": "ep all-to-all", "pp": "pp sends",
               "dp_all_gather": "dp all-gather exposed", "dp_reduce_scatter": "dp reduce-scatter exposed",
               "dp_replicate_all_reduce": "dp_replicate all-reduce exposed", "bubble": "pp bubble",
               "optimizer": "optimizer", "offload": "offload copies"}


@attrs.frozen
class Ceiling(_Throughput):
    """The step of the slowest rank if only its GEMMs and attention took time, at `hardware`'s
    measured rates: what the step would be with every element-wise kernel, collective and host
    stall gone. Matmuls a recompute mode runs again count, and so does a pipeline's bubble (the
    schedule's, not the kernels')."""

    gemm: float             # seconds per step: the blocks' and the head's matmuls
    attention: float
    bubble: float

    @property
    def seconds(self) -> float:
        return self.gemm + self.attention + self.bubble

    def as_dict(self) -> dict[str, float]:
        return {"gemm_s": round(self.gemm, 5), "attention_s": round(self.attention, 5),
                "bubble_s": round(self.bubble, 5), "seconds": round(self.seconds, 5),
                "tokens_per_sec_per_gpu": round(self.tokens_per_sec_per_gpu, 1),
                "mfu_pct": round(100 * self.mfu(), 2)}


def predict_step(layout: RunLayout, hardware: Hardware = H200) -> StepTime:
    """The step time of a run's layout on `hardware`."""
    return max((predict_workload(w, hardware) for w in _slowest_candidates(layout)), key=lambda s: s.seconds)


def ceiling(layout: RunLayout, hardware: Hardware = H200) -> Ceiling:
    """The step of a run's layout if only GEMMs and attention took time (see Ceiling)."""
    return max((_workload_ceiling(w, hardware) for w in _slowest_candidates(layout)), key=lambda c: c.seconds)


def _slowest_candidates(layout: RunLayout) -> list[Workload]:
    """The ranks one of which is the slowest: the first, and under pp the last stage's (the head)."""
    first = workload(layout, 0)
    return [first] if layout.mesh.pp == 1 else [first, workload(layout, layout.world_size - 1)]


def _workload_ceiling(work: Workload, hw: Hardware) -> Ceiling:
    gemm = attention = 0.0
    for stage in work.stages:
        for block, mode, count in work.block_mix(stage):
            gemm += count * MATMULS_RUN[mode] * kernels.gemm_seconds(work, block, hw)[0]
            attention += count * MATMULS_RUN[mode] * kernels.attention_seconds(work, block, hw) * work.repeats(block)
        if stage.last:
            gemm += kernels.head_gemm_seconds(work, hw)[0] * (1 + work.mtp_depth)
    m, split = work.num_microbatches, work.layout.pipeline
    gemm, attention = m * gemm, m * attention
    bubble_share = pipeline.bubble_fraction(split.schedule, work.mesh_spec.pp, split.virtual_stages, m)
    d = work.config.data
    return Ceiling(gemm=gemm, attention=attention, bubble=(gemm + attention) * bubble_share / (1 - bubble_share),
                   tokens=d.global_batch * d.seq_len, world_size=work.mesh_spec.world_size,
                   flops_per_token=_flops_per_token(work.model_cfg, d.seq_len), peak_tflops=hw.peak_tflops)


def predict_workload(work: Workload, hardware: Hardware = H200) -> StepTime:
    d, split = work.config.data, work.layout.pipeline
    m = work.num_microbatches
    per_micro_batch = [_stage_seconds(work, stage, hardware) for stage in work.stages]
    compute = m * (sum(c for c, _ in per_micro_batch) + hardware.micro_batch_overhead_s)
    if work.mesh_spec.pp > 1 and split.schedule in ("gpipe", "looped-bfs"):
        compute *= 1 + hardware.breadth_first_slowdown
    waits: dict[str, float] = {}
    for _, stage_waits in per_micro_batch:
        for dim, seconds in stage_waits.items():
            waits[dim] = waits.get(dim, 0.0) + m * seconds
    bubble_share = pipeline.bubble_fraction(split.schedule, work.mesh_spec.pp, split.virtual_stages, m)
    bubble = (compute + sum(waits.values())) * bubble_share / (1 - bubble_share)
    optimizer, offload = optimizer_seconds(work, hardware)
    return StepTime(
        compute=compute, waits=waits, data_parallel=fsdp_exposed_seconds(work, compute, hardware), bubble=bubble,
        optimizer=optimizer, offload=offload, overhead=hardware.step_overhead_s,
        tokens=d.global_batch * d.seq_len, world_size=work.mesh_spec.world_size,
        flops_per_token=_flops_per_token(work.model_cfg, d.seq_len), peak_tflops=hardware.peak_tflops,
    )


@functools.lru_cache(maxsize=256)
def _flops_per_token(model_cfg, seq_len: int) -> float:
    return flops.flops_per_token(model_cfg, seq_len)


def _stage_seconds(work: Workload, stage: Stage, hw: Hardware) -> tuple[float, dict[str, float]]:
    """(compute, waited-for collectives per mesh dim) of one micro-batch of a stage, forward and
    backward."""
    t, mesh = work.config.train, work.mesh_spec
    compute = 0.0
    waits: dict[str, float] = {}
    for block, mode, count in work.block_mix(stage):
        block_compute, block_waits = _block_seconds(work, block, mode, hw)
        compute += count * block_compute
        for dim, seconds in block_waits.items():
            waits[dim] = waits.get(dim, 0.0) + count * seconds
    # The vocab-parallel lookup (first stage) and the head's input (last stage) are summed over tp.
    ends = stage.first + stage.last
    if stage.last:
        # Each MTP module's prediction runs the head and its loss once more.
        compute += kernels.head_seconds(work, hw) * (1 + work.mtp_depth)
    if mesh.tp > 1 and ends:
        waits["tp"] = waits.get("tp", 0.0) + ends * _allreduce(work.tokens * _residual_bytes(work), mesh.tp,
                                                                  hw.link_gb_s(mesh.tp), hw)
    if mesh.pp > 1:
        span = mesh.world_size // mesh.pp * 2
        sent = work.tokens * DTYPE_BYTES[t.precision] * (work.model_cfg.dim / mesh.tp if work.plan.sequence_parallel
                                                         else work.model_cfg.dim)
        waits["pp"] = 2 * sent / (hw.link_gb_s(span) * GIGA)
    return compute, waits


def _residual_bytes(work: Workload) -> float:
    return DTYPE_BYTES[work.config.train.precision] * work.model_cfg.dim


def _block_seconds(work: Workload, block: int, mode: str, hw: Hardware) -> tuple[float, dict[str, float]]:
    """One micro-batch of one block on this rank: compute and waited-for collectives per mesh dim."""
    mesh, t = work.mesh_spec, work.config.train
    gemm, casts = kernels.gemm_seconds(work, block, hw)
    attention = kernels.attention_seconds(work, block, hw)
    masked = work.config.data.document_mask or any(work.attention_extent(block).values())
    if mesh.cp > 1 and work.config.parallel.cp_comm == "ring" and masked:
        attention *= hw.masked_ring_slowdown
    elementwise = (hw.elementwise_traffic * activations.block_bytes(work, block, "none")
                   / (hw.hbm_tb_s * TERA)) * (1 if t.compile else 2)
    # The MTP layer's weights (and saved bytes) hold all its modules; each module attends, and
    # waits for its collectives, once.
    compute = (gemm + casts + attention * work.repeats(block)) * MATMULS_RUN[mode] + elementwise * ELEMENTWISE_RUN[mode]
    waits = {}
    residual = work.tokens * _residual_bytes(work)
    moe = work.is_moe(block)
    if mesh.tp > 1:
        # Attention and MLP regions: an all-reduce (or all-gather and reduce-scatter under SP)
        # each, forward and backward; an MoE layer gathers its tp ranks' token shares instead.
        regions = 3 if moe else 4
        if mode == "full":
            regions += 1.5 if moe else 2
        waits["tp"] = regions * (_allreduce(residual, mesh.tp, hw.link_gb_s(mesh.tp), hw) + hw.tp_region_s)
    if mesh.cp > 1:
        waits["cp"] = _context_parallel_seconds(work, attention, hw)
    if moe and mesh.ep > 1:
        waits["ep"] = _expert_parallel_seconds(work, hw) * (1.5 if mode == "full" else 1)
    return compute, {dim: seconds * work.repeats(block) for dim, seconds in waits.items()}


def _context_parallel_seconds(work: Workload, attention: float, hw: Hardware) -> float:
    """allgather: K/V gathered forward and their gradients reduce-scattered backward, waited for;
    ring: the K/V blocks travel while the previous block is attended to (what attention does not
    hide is waited for); a2a: q, k, v to head shards and the output back, forward and backward."""
    cfg, mesh, method = work.model_cfg, work.mesh_spec, work.config.parallel.cp_comm
    b = DTYPE_BYTES[work.config.train.precision]
    heads = math.ceil(cfg.num_heads / mesh.tp)
    kv_heads = math.ceil(cfg.num_kv_heads / mesh.tp) if cfg.num_kv_heads >= mesh.tp else cfg.num_kv_heads
    kv = work.tokens * 2 * kv_heads * cfg.head_dim * b
    link = hw.link_gb_s(mesh.tp * mesh.cp) * GIGA
    if method == "allgather":
        return 2 * (mesh.cp - 1) * kv / link + 2 * hw.collective_latency_s
    if method == "ring":
        moved = 3 * (mesh.cp - 1) * kv / link
        return max(0.0, moved - attention) + 3 * (mesh.cp - 1) * hw.collective_latency_s
    exchanged = work.tokens * (2 * heads + 2 * kv_heads) * cfg.head_dim * b * (mesh.cp - 1) / mesh.cp
    return 2 * exchanged / link + 4 * hw.collective_latency_s


def _expert_parallel_seconds(work: Workload, hw: Hardware) -> float:
    """Tokens to their experts and back, forward and backward: top_k rows per token over the
    all-to-all (those for the other ep ranks leave the rank), or ep - 1 whole tokens gathered and
    reduce-scattered by the all-gather dispatch; the rows for ranks of the same node cross NVLink,
    the others the network, both at once (`Hardware.exchange_seconds`). The all-to-all also reads
    its split sizes on the host, which stalls the launch queue."""
    cfg: MoEConfig = work.model_cfg
    mesh = work.mesh_spec
    b = DTYPE_BYTES[work.config.train.precision]
    tokens = work.tokens / mesh.tp
    # The ep ranks are dp_shard x cp ranks, tp apart; folding tp in, neighbours.
    stride = 1 if mesh.experts_fold_tp else mesh.tp
    if work.ep_dispatch == "allgather":
        return 4 * hw.exchange_seconds(tokens * cfg.dim * b * mesh.ep, mesh.ep, stride) + 4 * hw.collective_latency_s
    moved = 4 * cfg.top_k * tokens * cfg.dim * b
    return hw.exchange_seconds(moved, mesh.ep, stride) + 6 * hw.collective_latency_s + 2 * HOST_SYNC_S


# A host read of device data: the launch queue drains and refills.
HOST_SYNC_S = 100e-6



def _allreduce(size: float, ranks: int, link_gb_s: float, hw: Hardware) -> float:
    if ranks == 1:
        return 0.0
    return 2 * size * (ranks - 1) / ranks / (link_gb_s * GIGA) + hw.collective_latency_s
