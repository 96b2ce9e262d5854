"""`--print-plan`: a run's layout printed without training: the sharding plan of every parameter,
the pipeline stages, the run's other decisions (kernels, FP8, recompute, FSDP units) and the
predicted memory per rank; with --json, the layout's `to_dict()`."""

from __future__ import annotations

import json

from dtrain.layout import RunLayout
from dtrain.planner import memory
from dtrain.planner.advice import gpu_memory_gb, gpu_memory_source
from dtrain.planner.hardware import GIGA
from models import flops
from parallel.mesh import MeshSpec


def print_plan(layout: RunLayout) -> None:
    if layout.config.parallel.json:
        print(json.dumps(layout.to_dict(), indent=1))
        return
    print(layout.plan.describe(layout.layers))
    if layout.mesh.pp > 1:
        print(describe_stages(layout))
    print("\n".join(decision_lines(layout)))
    print("\n".join(memory_lines(layout)))


def decision_lines(layout: RunLayout) -> list[str]:
    """The run's decisions beyond the plan and the stages, a line each."""
    par, mesh = layout.parallel, layout.mesh
    roles = "; ".join(f"{role} over {'x'.join(dims)}" for role, dims in mesh.roles().items())
    lines = [choice.line() for choice in layout.chosen]  # the options left unset, as chosen
    lines += [f"roles: {roles}",
              f"batch: micro-batch {layout.config.data.micro_batch}, global batch {layout.config.data.global_batch}, "
              f"{layout.num_microbatches} micro-batches per step on each data-parallel rank"]
    kernels = [f"{par.precision}"] + ["compiled"] * par.compile
    if par.tp_overlap is not None:
        kernels.append(f"tp overlap {par.tp_overlap}")
    if par.async_tp:
        kernels.append("async tp")
    if mesh.cp > 1:
        kernels.append(f"cp attention {par.cp_comm}")
    if par.ep_dispatch is not None:
        kernels.append(f"ep dispatch {par.ep_dispatch}")
    kernels += [f"{name} attention: {kernel}" for name, kernel in layout.masked_attention_kernels().items()]
    lines.append("kernels: " + ", ".join(kernels))
    if par.fp8 is not None:
        fp8 = par.fp8
        gather = "float8" if fp8.all_gather else f"bf16 ({fp8.all_gather_blocker})"
        lines.append(f"fp8: {fp8.recipe} ({fp8.backend}) on {len(fp8.layers)} blocks{' and the head' * fp8.head}; "
                     f"FSDP gathers their weights in {gather}")
    if par.fp8_experts is not None:
        experts = par.fp8_experts
        lines.append(f"fp8 experts: {experts.backend}'s grouped GEMMs on the routed experts of {len(experts.layers)} "
                     f"blocks{' (emulated)' * (experts.backend == 'torchao' and experts.emulated)}")
    full = f" + full on {len(par.full_recompute)} blocks" if par.full_recompute else ""
    lines.append(f"recompute: {par.recompute}{full}")
    fsdp = par.fsdp
    lines.append(f"fsdp: {fsdp.dp_mode}, {len(fsdp.resharded)} units freed after forward, reduce once: "
                 f"{fsdp.to_dict()['reduce_once']}{', CPU offload' * fsdp.cpu_offload}")
    return lines


def stage_text(blocks_per_stage: list[int], stage: int, mtp_depth: int = 0) -> str:
    """`embedding + blocks 0-9`, `blocks 10-19`, `blocks 71-79 + head` (`+ MTP + head` where the
    model has multi-token prediction, which runs on the last stage)."""
    first = sum(blocks_per_stage[:stage])
    last = first + blocks_per_stage[stage] - 1
    parts = ["embedding"] if stage == 0 else []
    parts.append(f"block {first}" if first == last else f"blocks {first}-{last}")
    if stage == len(blocks_per_stage) - 1:
        parts += [*(["MTP" if mtp_depth == 1 else f"{mtp_depth} MTP modules"] if mtp_depth else []), "head"]
    return " + ".join(parts)


def describe_stages(layout: RunLayout) -> str:
    """A table of the pipeline stages: blocks, layers, and the ranks that hold each."""
    mesh_spec, split = layout.mesh, layout.pipeline
    counts = list(split.blocks_per_stage)
    ranks_of_pp_rank = _ranks_of_pp_rank(mesh_spec)
    pp_rank_of_stage = {stage: pp_rank for pp_rank in range(mesh_spec.pp) for stage in split.stage_ids(pp_rank)}
    rows = [("stage", "blocks", "layers", "pp rank", "ranks")]
    depth = flops.mtp_depth(layout.model_cfg)
    for stage, count in enumerate(counts):
        pp_rank = pp_rank_of_stage[stage]
        rows.append((str(stage), str(count), stage_text(counts, stage, depth), str(pp_rank),
                     rank_ranges(tuple(ranks_of_pp_rank[pp_rank]))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"pipeline: {split.schedule}, {split.num_stages} stages ({mesh_spec.pp} ranks x "
             f"{split.virtual_stages} per rank), {split.num_microbatches} micro-batches per step on each "
             f"data-parallel rank"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _ranks_of_pp_rank(mesh_spec: MeshSpec) -> dict[int, list[int]]:
    ranks: dict[int, list[int]] = {}
    for rank in range(mesh_spec.world_size):
        ranks.setdefault(mesh_spec.coordinates(rank)["pp"], []).append(rank)
    return ranks


def rank_ranges(ranks: tuple[int, ...]) -> str:
    """`0-7,64-71` for runs of consecutive ranks."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def assumptions_line(layout: RunLayout) -> str:
    """What the memory figures assume: the sequence, the batch, and the GPU's memory."""
    d = layout.config.data
    return (f"assumed: sequences of {d.seq_len} tokens (--seq-len), micro-batch {d.micro_batch}, global batch "
            f"{d.global_batch}, GPUs of {gpu_memory_gb(layout.config):g} GB ({gpu_memory_source(layout.config)})")


def does_not_fit(peak_bytes: float, layout: RunLayout) -> str:
    """'' where `peak_bytes` fits the GPU, else a warning that says what to look at."""
    limit = gpu_memory_gb(layout.config)
    if peak_bytes <= limit * GIGA:
        return ""
    return (f" -- DOES NOT FIT a {limit:g} GB GPU: python -m dtrain.planner --model {layout.config.model.model} "
            f"--gpus {layout.world_size} --seq-len {layout.config.data.seq_len} lists layouts that fit")


def memory_lines(layout: RunLayout) -> list[str]:
    """The predicted peak GPU memory of each pipeline stage's ranks (every rank of a stage holds
    the same), as python -m dtrain.planner predicts it, each checked against the GPU's memory."""
    mesh_spec = layout.mesh
    lines = [assumptions_line(layout), "memory per rank (predicted peak, by category in GB):"]
    for pp_rank, ranks in sorted(_ranks_of_pp_rank(mesh_spec).items()):
        held_by = f"{'ranks' if len(ranks) > 1 else 'rank'} {rank_ranges(tuple(ranks))}"
        label = f"pp rank {pp_rank} ({held_by})" if mesh_spec.pp > 1 else held_by
        predicted = memory.predict(layout, ranks[0])
        lines.append(f"  {label}: {predicted.lines()[0]}{does_not_fit(predicted.total, layout)}")
    return lines
