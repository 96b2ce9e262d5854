"""FSDP's and the optimizer's share of a step (dtrain/planner/steptime.py): the collectives that
compute cannot hide, the copies into and out of their buffers, the sums of the gradients over a
step's micro-batches, and the AdamW step."""

from __future__ import annotations

from dtrain.planner.activations import DTYPE_BYTES
from dtrain.planner.hardware import GIGA, TERA, Hardware
from dtrain.planner.workload import Workload

# Bytes of AdamW state touched per trainable element in one fused step, with the gradient-norm
# pass: read and write the fp32 weight and both moments, read the fp32 gradient (twice).
OPTIMIZER_BYTES = 32
# FSDP's copies per gathered element and step: the fp32 shard cast into the all-gather input and
# copied out of its output, the gradient cast to fp32 into the reduce-scatter input and out.
FSDP_COPY_BYTES = 24
# Bytes per element of adding a later micro-batch's gradients into the fp32 sum: whole, where a
# unit reduces once per step (read the gradient in the compute dtype and the sum, write the sum),
# or shard-wise after each reduce-scatter (read two fp32 tensors, write one).
ACCUMULATE_WHOLE_BYTES = 8  # plus the compute dtype's bytes
ACCUMULATE_SHARD_BYTES = 12


def fsdp_exposed_seconds(work: Workload, compute: float, hw: Hardware) -> dict[str, float]:
    """FSDP's collectives of one step, by kind ("dp_all_gather", "dp_reduce_scatter",
    "dp_replicate_all_reduce"): what compute cannot hide, and the slowdown of the compute they
    overlap. The first all-gather and the last reduce-scatter are never hidden. Where units are
    gathered and reduced once per step (pipelining, --fsdp-reduce-once, ZeRO-1) their all-gathers
    can hide only behind the step's first forward and their reductions behind its last backward;
    else behind the forwards and backwards of every micro-batch. An overlapped collective slows the
    compute beside it by `overlap_slowdown` of the time NVLink would take to move its bytes (its
    kernels' share of the SMs and of HBM grows with the bytes it moves per second, so a collective
    over the slower network slows compute less per second of overlap)."""
    mesh = work.mesh_spec
    totals = work.unit_totals()
    m = work.num_microbatches
    once = work.layout.parallel.fsdp.reduce_once
    span = mesh.tp * mesh.cp * mesh.dp_shard
    link_gb_s = hw.link_gb_s(span)
    link = link_gb_s * GIGA
    # Units kept gathered are gathered once per micro-batch (once per step where gradients are
    # reduced once); resharded units again for each backward.
    kept_gathers, resharded_gathers, reductions = (1 if once else m), 2 * m, (1 if once else m)
    forward, backward = compute / 3, 2 * compute / 3
    # (seconds, what compute it may hide behind, its link's bandwidth per GPU)
    parts = {
        "dp_all_gather": ((kept_gathers * totals.share_kept_bytes + resharded_gathers * totals.share_resharded_bytes)
                          / link + totals.collectives * kept_gathers * hw.collective_latency_s,
                          forward / m + (compute if totals.share_resharded_bytes else 0.0) if once else compute,
                          link_gb_s),
        "dp_reduce_scatter": (reductions * (4 * totals.share_reduced / link + totals.collectives * hw.collective_latency_s),
                              backward / m if once else backward, link_gb_s),
    }
    if mesh.dp_replicate > 1:
        # HSDP all-reduces each unit's shards over the replicas as often as the unit reduces.
        replicas = mesh.dp_replicate
        reduced = sum(u.trainable * (1 if work.reduces_once(u) else m) for u in work.all_units())
        replica_link = hw.link_gb_s(span * replicas)
        parts["dp_replicate_all_reduce"] = (4 * reduced * 2 * (replicas - 1) / replicas / (replica_link * GIGA),
                                            backward / m if once else backward, replica_link)
    if not sum(seconds for seconds, _, _ in parts.values()):
        return {}
    unhidden = {"dp_all_gather": totals.first_gather_bytes / link, "dp_reduce_scatter": 4 * totals.last_reduced / link}
    exposed, free = {}, compute
    for name, (seconds, window, link_used) in parts.items():
        fixed = min(unhidden.get(name, 0.0), seconds)
        hidden = min(seconds - fixed, window, free)
        free -= hidden
        # Moving bytes at the network's pace takes fewer SMs' time per second than at NVLink's.
        exposed[name] = seconds - hidden + hw.overlap_slowdown * hidden * min(1.0, link_used / hw.nvlink_gb_s)
    return exposed


def optimizer_seconds(work: Workload, hw: Hardware) -> tuple[float, float]:
    """(The AdamW step, FSDP's copies into and out of its collectives' buffers (the cast of the
    fp32 shards for the all-gather, the gradients into fp32 for the reduce-scatter), and the sums of
    the gradients over the step's micro-batches; --cpu-offload's copies between host and GPU)."""
    totals = work.unit_totals()
    trainable = totals.trainable
    copies = FSDP_COPY_BYTES * totals.gathered_trainable / (hw.hbm_tb_s * TERA)
    if not work.layout.parallel.fsdp.cpu_offload:
        return (OPTIMIZER_BYTES * trainable + accumulated_bytes(work)) / (hw.hbm_tb_s * TERA) + copies, 0.0
    # Gradients come to the host, the step runs on the CPU, and the weights go back each step.
    return OPTIMIZER_BYTES * trainable / (hw.cpu_adam_gb_s * GIGA), 4 * trainable * 2 / (hw.host_gb_s * GIGA)


def accumulated_bytes(work: Workload) -> float:
    """What the gradient sums of a step's later micro-batches move: whole where a unit reduces
    once per step (`Workload.reduces_once`), else shard-wise. Under MoE the sums cover every
    expert, however few each token runs."""
    whole_bytes = ACCUMULATE_WHOLE_BYTES + DTYPE_BYTES[work.config.train.precision]
    total = sum(whole_bytes * u.gathered_trainable if work.reduces_once(u) else ACCUMULATE_SHARD_BYTES * u.trainable
                for u in work.all_units())
    return (work.num_microbatches - 1) * total
