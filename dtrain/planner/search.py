"""The planner: every layout of a model on a number of GPUs, the ones that fit, the fastest first.

    from dtrain.planner.candidates import Fixed, Target
    from dtrain.planner.search import search
    target = Target(model="llama3-70b", gpus=128, gpu="h100-sxm", seq_len=8192, global_batch=1024)
    best = search(target)[:3]         # Candidates: mesh, micro-batch, recompute, memory, tokens/s
    print(best[0].command)
    given = search(attrs.evolve(target, fixed=Fixed(mesh="pp=4,dp_shard=4,tp=8")))[0]
    given.fits, given.step.bound_by()

It enumerates the meshes (meshes.py), then for each the micro-batch, the recompute mode (none,
selective, full, or full on some blocks per stage), the data-parallel mode (FSDP resharding after
forward or not, ZeRO-1) and CPU offload (kept only where no layout fits without it); keeps the
candidates whose predicted peak (memory.py, the largest over the ranks) fits the GPU; and sorts them
by predicted tokens/s per GPU (steptime.py). Choices the target fixes are not searched. A fixed mesh
that fits in no way is still answered: its least-memory variant, with `fits` False. Each mesh's
workload is built once and its variants derived from it, so a 16,384-GPU search takes seconds.
"""

from __future__ import annotations

import math

import attrs

from dtrain.layout import RunLayout, with_choices
from dtrain.planner import memory, steptime
from dtrain.planner.candidates import Candidate, Fixed, Target
from dtrain.planner.hardware import GIGA, Hardware
from dtrain.planner.meshes import MeshBase, mesh_bases
from models.errors import UserError

MICRO_BATCHES = (1, 2, 4, 8, 16)
# (--recompute, share of each stage's blocks under full recompute: --recompute-layers)
RECOMPUTE = (("none", 0.0), ("selective", 0.0), ("none", 0.5), ("selective", 0.5), ("full", 0.0))


def search(target: Target) -> list[Candidate]:
    """The candidates that fit, fastest first, with CPU offload only where none fits without it;
    for a fixed mesh that fits in no way, its least-memory variant alone, marked `fits=False`.
    Where a run would refuse every mesh, the first mesh's refusal is raised (it names the option at
    fault)."""
    hw = target.hardware
    found, nearest, refusals, resolved = [], None, [], False
    for base in mesh_bases(target, refusals):
        resolved = True
        fitting, closest = _variants(target, base, hw)
        found += fitting
        if closest is not None and (nearest is None or closest[1].total < nearest[1].total):
            nearest = closest
    if not resolved and refusals:
        raise refusals[0]
    if not found and target.fixed.mesh is not None:
        if nearest is None:
            raise UserError(f"--mesh {target.fixed.mesh} with --global-batch {target.global_batch}: no micro-batch "
                            f"(of {', '.join(map(str, MICRO_BATCHES))}, or the one given) gives each data-parallel rank "
                            f"whole micro-batches, and under pp at least pp of them (a multiple of pp when "
                            f"interleaved); change --global-batch or --micro-batch")
        layout, peak, base = nearest
        return [Candidate(layout, peak, _step(base, layout, hw), target.gpus, target.gpus_per_node, target.gpu, False)]
    # CPU offload only where no layout fits without it: where one mesh needs the host's memory and
    # a CPU step and another does without, the one that fits on the GPUs is what to run.
    found = [c for c in found if not c.config.parallel.cpu_offload] or found
    return sorted(found, key=lambda c: (-c.tokens_per_sec_per_gpu, c.memory.total))


def _step(base: MeshBase, layout: RunLayout, hw: Hardware) -> steptime.StepTime:
    return max((steptime.predict_workload(w.with_layout(layout), hw) for w in base.works), key=lambda s: s.seconds)


def _variants(target: Target, base: MeshBase, hw: Hardware) -> tuple[list[Candidate], tuple | None]:
    """For each data-parallel mode and micro-batch of a mesh, the first recompute choice that
    fits (the ones after it only recompute more); CPU offload only where nothing fits without it.
    A micro-batch that fits in no way ends the larger ones; one a run would refuse is left out.
    Memory is predicted first, the first pipeline rank before the last: most variants of a large
    model do not fit, and are not timed. Also the least-memory variant tried, (layout, peak,
    base), for a fixed mesh that fits nowhere."""
    budget, host_budget = hw.gpu_memory_bytes, hw.host_bytes_per_gpu
    fixed, nearest = target.fixed, None
    for offload in (False, True):
        if not fixed.allows("cpu_offload", offload):
            continue
        found = []
        for dp_mode, reshard in _data_parallel_modes(target, base, offload):
            for micro_batch in _micro_batches(target):
                fits, tried = None, False
                for mode, layers in _recompute_choices(target, base):
                    try:
                        layout = with_choices(base.layout, micro_batch=micro_batch, recompute=mode,
                                              recompute_layers=layers, dp_mode=dp_mode,
                                              fsdp_reshard_after_forward=reshard, cpu_offload=offload)
                    except UserError:
                        continue  # a run would refuse it
                    tried = True
                    peaks = []
                    for work in base.works:
                        peaks.append(memory.predict_workload(work.with_layout(layout)))
                        # A fixed mesh's peaks are all wanted: the nearest, if nothing fits.
                        if fixed.mesh is None and (peaks[-1].total > budget or peaks[-1].host > host_budget):
                            break
                    peak = max(peaks, key=lambda b: b.total)
                    if peak.total <= budget and max(b.host for b in peaks) <= host_budget and len(peaks) == len(base.works):
                        fits = layout, peak
                        break
                    if fixed.mesh is not None and (nearest is None or peak.total < nearest[1].total):
                        nearest = layout, peak, base
                if fits is None:
                    if fixed.mesh is None and tried:
                        break
                    continue
                layout, peak = fits
                found.append(Candidate(layout, peak, _step(base, layout, hw), target.gpus, target.gpus_per_node,
                                       target.gpu))
        if found:
            return found, None
    return [], nearest


def _data_parallel_modes(target: Target, base: MeshBase, offload: bool) -> list[tuple[str, str]]:
    """(--dp-mode, --fsdp-reshard-after-forward) pairs worth trying: without pipelining and with
    more than one shard, FSDP resharding after forward (the default) or not, and ZeRO-1; under
    pipelining FSDP keeps the parameters gathered and reduces once already (what ZeRO-1 does)."""
    fixed = target.fixed
    if base.pp == 1 and base.fsdp_ranks > 1:
        modes = [("fsdp", "default"), ("fsdp", "never"), ("zero1", "default")]
    else:
        modes = [("fsdp", "default")]
    if fixed.dp_mode is not None or fixed.fsdp_reshard_after_forward is not None:
        modes = [(fixed.dp_mode or "fsdp", fixed.fsdp_reshard_after_forward or "default")]
    return [(mode, reshard) for mode, reshard in modes if not (mode == "zero1" and offload)]


def _micro_batches(target: Target) -> tuple[int, ...]:
    """Micro-batches to try, smallest first (those the global batch or the pipeline schedule does
    not take, a run refuses)."""
    return MICRO_BATCHES if target.fixed.micro_batch is None else (target.fixed.micro_batch,)


def _recompute_choices(target: Target, base: MeshBase) -> list[tuple[str, int]]:
    """From the least recompute to the most: none, selective, full on half of each stage's
    blocks (with none or selective on the rest), full; only those the target allows."""
    blocks = max(base.works[0].counts)
    fixed = target.fixed
    choices = [(mode, math.ceil(blocks * share)) for mode, share in RECOMPUTE]
    if fixed.recompute_layers is not None:
        choices = [(mode, fixed.recompute_layers) for mode in dict.fromkeys(mode for mode, _ in choices)
                   if mode != "full" or not fixed.recompute_layers]
    return [(mode, layers) for mode, layers in dict.fromkeys(choices) if fixed.allows("recompute", mode)]


def minimum_memory(target: Target) -> dict[bool, float]:
    """The smallest predicted peak over every layout, without and with CPU offload (where host
    memory holds what it moves): one sample per micro-batch, full recompute."""
    lowest = {False: math.inf, True: math.inf}
    host_budget = target.hardware.host_bytes_per_gpu
    for base in mesh_bases(target):
        for offload in (False, True):
            try:
                layout = with_choices(base.layout, recompute="full", cpu_offload=offload)
            except UserError:
                continue  # a run would refuse it
            peaks = [memory.predict_workload(w.with_layout(layout)) for w in base.works]
            if max(b.host for b in peaks) <= host_budget:
                lowest[offload] = min(lowest[offload], max(b.total for b in peaks))
    return lowest


def _fits(target: Target) -> bool | None:
    """False where some layout fits without CPU offload, True where only offloaded ones do, None
    where none does."""
    lowest = minimum_memory(target)
    budget = target.memory_gb * GIGA
    return False if lowest[False] <= budget else True if lowest[True] <= budget else None


def nothing_fits(target: Target) -> str:
    """One line for a model that fits nowhere: the nearest GPU count, sequence length and
    precision at which something fits (and whether only with CPU offload)."""
    target = attrs.evolve(target, fixed=Fixed())
    what = (f"{target.model} at --seq-len {target.seq_len} and --global-batch {target.global_batch} does not fit "
            f"on {target.gpus} GPUs of {target.memory_gb:g} GB with any mesh, micro-batch, recompute or CPU offload")
    options = []
    for gpus in (2 ** k * target.gpus for k in range(1, 7)):
        # At least one sample per GPU, so that every split of the world is a candidate.
        offload = _fits(attrs.evolve(target, gpus=gpus, global_batch=max(target.global_batch, gpus)))
        if offload is not None:
            options.append(f"on {gpus} GPUs" + (" with --cpu-offload" if offload else ""))
            break
    seq = target.seq_len // 2
    while seq >= 256:
        offload = _fits(attrs.evolve(target, seq_len=seq))
        if offload is not None:
            options.append(f"with --seq-len {seq}" + (" and --cpu-offload" if offload else ""))
            break
        seq //= 2
    offload = _fits(attrs.evolve(target, fp8="tensorwise", fp8_backend="torchao")) if target.fp8 is None else None
    if offload is not None:
        options.append("with --fp8 tensorwise" + (" and --cpu-offload" if offload else ""))
    if not options:
        return f"{what}; nothing within 64x the GPUs or down to --seq-len 256 fits either"
    return f"{what}; it fits " + ", or ".join(options)
