"""The memory model: the peak of one rank's GPU memory in a training step, by category.

    from dtrain.planner.memory import predict
    breakdown = predict(layout, rank=0)     # layout: dtrain.layout.resolve(config, 128, machine)
    breakdown.total                     # bytes, as torch.cuda.max_memory_allocated would see
    print("\\n".join(breakdown.lines()))

It adds what the rank holds (workload.py: the plan's shards and gathered sizes of every FSDP
unit of its pipeline stages) in the dtypes dtrain keeps them: fp32 master weights, fp32
gradients, AdamW's two fp32 moments, bf16 (or float8) compute copies that FSDP gathers, and the
activations of the micro-batches its schedule holds at once (activations.py). The peak is the
larger of two moments of the step: the start of a micro-batch's backward (everything saved, the
head's logits, the first gradient buffers) and the end of the last backward (every gradient).
"""

from __future__ import annotations

import attrs

from dtrain.layout import RunLayout
from dtrain.planner import activations
from dtrain.planner.activations import DTYPE_BYTES, KernelFacts
from dtrain.planner.workload import Stage, Workload, workload
from parallel import pipeline

GB = 1e9

# Library workspaces outside the tensors above (cuBLAS, cuDNN, the compiled graphs' scratch),
# fitted on benchmarks/results.jsonl; the largest share of a peak in the llama-1b pp=2 rows of
# 75c3da5 (1.4% of their 22 GB).
WORKSPACE_BYTES = 0.3 * GB


@attrs.frozen
class MemoryBreakdown:
    """Bytes per category at the rank's peak. `host` (CPU offload) is not part of the total."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    logits: float
    buffers: float
    workspace: float
    host: float = 0.0
    phase: str = ""

    CATEGORIES = ("parameters", "gradients", "optimizer", "gathered", "activations", "logits", "buffers",
                  "workspace")

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in self.CATEGORIES)

    def as_gb(self) -> dict[str, float]:
        values = {name: round(getattr(self, name) / GB, 2) for name in self.CATEGORIES}
        values["total"] = round(self.total / GB, 2)
        if self.host:
            values["host"] = round(self.host / GB, 2)
        return values

    def lines(self) -> list[str]:
        """One line: the total and each category, in GB."""
        parts = [f"{name} {getattr(self, name) / GB:.1f}" for name in self.CATEGORIES if getattr(self, name) >= 0.05 * GB]
        host = f" (+{self.host / GB:.1f} GB in host memory)" if self.host else ""
        return [f"{self.total / GB:.1f} GB at {self.phase}{host}: " + ", ".join(parts)]


def predict(layout: RunLayout, rank: int = 0, kernel: KernelFacts | None = None) -> MemoryBreakdown:
    """The peak GPU memory of `rank` (bytes by category) of a run's layout."""
    return predict_workload(workload(layout, rank), kernel)


def predict_peak(layout: RunLayout, kernel: KernelFacts | None = None) -> tuple[MemoryBreakdown, int]:
    """The largest prediction over the ranks, and a rank that has it: ranks differ by their
    pipeline stage (the embedding, the head, the micro-batches their schedule holds)."""
    per_stage = layout.world_size // layout.mesh.pp
    ranks = [pp_rank * per_stage for pp_rank in range(layout.mesh.pp)]
    predictions = [(predict(layout, r, kernel), r) for r in ranks]
    return max(predictions, key=lambda item: item[0].total)


def predict_workload(work: Workload, kernel: KernelFacts | None = None) -> MemoryBreakdown:
    """`kernel`: how the attention kernel saves its tensors (default: the layout's machine's)."""
    kernel = kernel or activations.kernel_facts(work.layout)
    t = work.config.train
    totals = work.unit_totals()
    compute_bytes = DTYPE_BYTES[t.precision]
    state = {"parameters": 4 * totals.local, "optimizer": 8 * totals.trainable}
    sharded_grads = 4 * totals.trainable
    host = 0.0
    if work.layout.parallel.fsdp.cpu_offload:
        host = state["parameters"] + state["optimizer"] + sharded_grads
        state = {name: 0.0 for name in state}
        sharded_grads = 0.0
    # One resharded unit being computed and the next one prefetched, with its all-gather buffer.
    in_use = totals.kept_bytes + 3 * totals.resharded_bytes

    logits, head_backward = activations.head_bytes(work) if any(s.last for s in work.stages) else (0.0, 0.0)
    # The reduce-scatter of the largest unit: its compute-dtype gradient, the fp32 copy FSDP
    # reduces, and the fp32 shard that comes out. Each unit is freed after its last backward, so
    # at the end only the one being reduced is still gathered.
    reduce_buffers = (compute_bytes + 4) * totals.largest_gathered_trainable + 4 * totals.largest_trainable

    end = (sharded_grads, totals.largest_bytes, 0.0, 0.0, reduce_buffers, "the end of backward")
    starts = [(accumulated, in_use, saved, logits, head_backward + _dispatch_buffers(work), phase)
              for saved, accumulated, phase in _backward_starts(work, totals.gathered_trainable, sharded_grads, kernel)]
    gradients, gathered, saved, logits, buffers, phase = max([end, *starts], key=lambda moment: sum(moment[:5]))
    return MemoryBreakdown(**state, gradients=gradients, gathered=gathered, activations=saved, logits=logits,
                           buffers=buffers, workspace=WORKSPACE_BYTES, host=host, phase=phase)


def _backward_starts(work: Workload, gathered_trainable: int, sharded_grads: float, kernel: KernelFacts):
    """(saved activations, gradients alive, phase) at the start of the first backward of a step,
    and of a later one, where the gradients of the micro-batches before it are kept: as fp32
    shards after each reduce-scatter, or whole in fp32 where they are reduced once per step
    (pipeline schedules, --fsdp-reduce-once; a unit with one shard, which reduces once by default,
    holds as much either way)."""
    par = work.layout.parallel
    per_stage = [_stage_bytes(work, stage, kernel) for stage in work.stages]
    pipelined = work.mesh_spec.pp > 1
    split = work.layout.pipeline
    chunks = (pipeline.chunks_in_flight(split.schedule, work.mesh_spec.pp, work.pp_rank, split.virtual_stages,
                                        work.num_microbatches) if pipelined else [0])
    extra = 0.0
    if par.recompute == "full" or par.full_recompute:
        # The block that backward recomputes holds its activations again, on top.
        extra = max(activations.recompute_peak_bytes(work, s.blocks[-1], kernel) for s in work.stages)

    def saved(held: list[int]) -> float:
        outputs = len(held) * activations.stage_output_bytes(work) if pipelined else 0.0
        # Each local stage's micro-batches held, counted (a schedule holds up to v x m of them).
        return sum(per_stage[c] * held.count(c) for c in range(len(per_stage))) + outputs + extra

    yield saved(chunks), 0.0, "the start of backward"
    if work.num_microbatches == 1:
        return
    whole = par.fsdp.reduce_once
    grads = 4 * gathered_trainable if whole else sharded_grads
    # Where every micro-batch is in flight at once (GPipe, looped BFS), a later backward starts
    # with one micro-batch fewer; in a steady 1F1B state the rank holds as many as before.
    everything = len(chunks) >= work.num_microbatches * len(work.stages)
    later = chunks[:-1] if pipelined and everything else chunks
    yield saved(later), grads, "the start of a later backward"


def _stage_bytes(work: Workload, stage: Stage, kernel: KernelFacts) -> float:
    """One micro-batch of a stage."""
    par = work.layout.parallel
    key = ("stage bytes", stage.index, par.recompute, par.full_recompute, work.tokens, kernel)
    if key not in work.memo:
        work.memo[key] = sum(count * activations.block_bytes(work, block, mode, kernel)
                             for block, mode, count in work.block_mix(stage))
    return work.memo[key]


def _dispatch_buffers(work: Workload) -> float:
    """Expert parallelism's exchange at one layer: the rows sent and received (top_k per token),
    ep times as many rows under the all-gather dispatch."""
    if work.ep_dispatch is None:
        return 0.0
    cfg = work.model_cfg
    b = DTYPE_BYTES[work.config.train.precision]
    rows = work.tokens / work.mesh_spec.tp * cfg.top_k
    if work.ep_dispatch == "allgather":
        rows *= work.mesh_spec.ep
    return 2 * b * rows * cfg.dim
