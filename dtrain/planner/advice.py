"""The planner inside a run: what `--mesh auto` chooses, and what a CUDA out-of-memory error
reports instead of a bare traceback (this rank's predicted breakdown and the nearest layout the
planner says fits)."""

from __future__ import annotations

import logging
import os

import attrs
import torch

from dtrain.config import Config
from dtrain.layout import Machine, RunLayout, resolve
from dtrain.layout.defaults import FALLBACK_MICRO_BATCH
from dtrain.planner import memory, steptime
from dtrain.planner.hardware import GIGA
from dtrain.planner import gpus
from dtrain.planner.candidates import Candidate, Fixed, Target, fp8_flags
from dtrain.planner.search import nothing_fits, search
from models.errors import UserError
from parallel.mesh import MeshSpec

logger = logging.getLogger("dtrain")

DEFAULT_GPU_MEMORY_GB = 80.0


def gpu_memory_gb(config: Config) -> float:
    """--gpu-memory-gb, else what the GPU reports, else 80 GB (a machine without GPUs)."""
    if config.parallel.gpu_memory_gb > 0:
        return config.parallel.gpu_memory_gb
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIGA
    return DEFAULT_GPU_MEMORY_GB


def gpu_memory_source(config: Config) -> str:
    """Where `gpu_memory_gb` took its figure from, in words."""
    if config.parallel.gpu_memory_gb > 0:
        return "--gpu-memory-gb"
    if torch.cuda.is_available():
        return "this machine's GPU; --gpu-memory-gb to change"
    return "no GPU here: the default; --gpu-memory-gb to change"


def gpus_per_node() -> int:
    """torchrun's processes per node, else the GPUs this host has, else a node of 8 (the host
    memory that CPU offload may use is shared by a node's GPUs)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    return torch.cuda.device_count() or 8


def target_of(config: Config, world_size: int, gpu: str | None = None, memory_gb: float | None = None,
              per_node: int | None = None) -> Target:
    """The planner's target for `config`'s model and data shape on `world_size` GPUs: `gpu`,
    `memory_gb` and `per_node` where given, else this machine's."""
    d, t = config.data, config.train
    return Target(model=config.model.model, model_overrides=config.model.model_overrides, gpus=world_size,
                  seq_len=d.seq_len,
                  global_batch=d.global_batch or (d.micro_batch or FALLBACK_MICRO_BATCH) * world_size,
                  gpu=gpu or gpus.detect(), gpu_memory_gb=memory_gb or gpu_memory_gb(config),
                  gpus_per_node=per_node or gpus_per_node(), fp8=t.fp8,
                  fp8_backend=t.fp8_backend, fp8_head=t.fp8_head, fp8_experts=t.fp8_experts,
                  loss_chunk_tokens=t.loss_chunk_tokens, compile=t.compile, precision=t.precision)


def resolve_run(config: Config, world_size: int | None, machine: Machine) -> RunLayout:
    """The layout of a run: `--mesh auto` chosen by the planner first (for `world_size`, 1 if
    None), then resolved (dtrain.layout.resolve)."""
    if config.parallel.mesh == "auto":
        # The planner chose the micro-batch and the resharding too: they stay its choices.
        return resolve(choose(config, world_size or 1), world_size, machine, planned=True)
    return resolve(config, world_size, machine)


def choose(config: Config, world_size: int) -> Config:
    """`--mesh auto`: the planner's best layout for this world (mesh, pipeline schedule,
    micro-batch, recompute, resharding, offload); the data shape and precision stay the user's.
    An unset --global-batch is --micro-batch x the world size. Logs the choice and the runner-up."""
    target = target_of(config, world_size)
    candidates = search(target)
    if not candidates:
        raise UserError(f"--mesh auto: {nothing_fits(target)}")
    chosen = apply(config, candidates[0])
    gpu = target.gpu
    logger.info("--mesh auto chose %s", summary(candidates[0], gpu))
    if len(candidates) > 1:
        logger.info("--mesh auto runner-up: %s", summary(candidates[1], gpu))
    if not torch.cuda.is_available():
        logger.info("--mesh auto: this machine has no GPU; the predictions are for %s GPUs (the planner's default "
                    "profile), not for this machine", gpu)
    return chosen


def apply(config: Config, candidate: Candidate) -> Config:
    """`config` with the layout of `candidate`."""
    c = candidate.config
    parallel = attrs.evolve(config.parallel, mesh=c.parallel.mesh, sequence_parallel=c.parallel.sequence_parallel,
                            pp_schedule=c.parallel.pp_schedule, pp_virtual_stages=c.parallel.pp_virtual_stages,
                            pp_layout="", fsdp_reshard_after_forward=c.parallel.fsdp_reshard_after_forward,
                            cpu_offload=c.parallel.cpu_offload, dp_mode=c.parallel.dp_mode)
    data = attrs.evolve(config.data, micro_batch=c.data.micro_batch, global_batch=c.data.global_batch)
    train = attrs.evolve(config.train, recompute=c.train.recompute, recompute_layers=c.train.recompute_layers)
    return attrs.evolve(config, parallel=parallel, data=data, train=train)


def summary(candidate: Candidate, gpu: str | None = None) -> str:
    """The candidate's flags that differ between layouts, its predicted peak and speed (on `gpu`'s
    profile, named where given)."""
    flags = candidate.command.split(" -m dtrain.run ", 1)[1].split()
    keep = {"--mesh", "--micro-batch", "--recompute", "--recompute-layers", "--pp-schedule", "--pp-virtual-stages",
            "--fsdp-reshard-after-forward", "--cpu-offload", "--sequence-parallel", "--dp-mode"}
    shown = [f"{flag} {value}" if value and not value.startswith("--") else flag
             for flag, value in zip(flags, flags[1:] + [""]) if flag in keep]
    on = f" on {gpu}" if gpu else ""
    return (f"{' '.join(shown)} (predicted{on} {candidate.memory.total / GIGA:.1f} GB per GPU, "
            f"{candidate.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU)")


def evaluate(layout: RunLayout, target: Target | None = None) -> Candidate:
    """The planner's view of the run of `layout` as it was resolved (`fits` False where it predicts
    no fit): memory per rank and step time on `target`'s GPU (default: this machine's, as
    `target_of`). Nothing is resolved or checked again."""
    target = target or target_of(layout.config, layout.world_size)
    hw = target.hardware
    peak, _ = memory.predict_peak(layout)
    fits = peak.total <= hw.gpu_memory_bytes and peak.host <= hw.host_bytes_per_gpu
    return Candidate(layout, peak, steptime.predict_step(layout, hw), target.gpus, target.gpus_per_node, target.gpu,
                     fits)


def nearest_fit(layout: RunLayout, target: Target) -> Candidate | None:
    """The layout that fits `target` and changes the fewest settings of `layout`, the fastest of
    those; None where nothing fits."""
    fits = search(attrs.evolve(target, fixed=Fixed()))
    return min(fits, key=lambda c: (_distance(c, layout.config, layout.mesh), -c.tokens_per_sec_per_gpu),
               default=None)


def _distance(candidate: Candidate, config: Config, mesh: MeshSpec) -> int:
    """How many settings a candidate changes: each mesh size, the micro-batch, recompute, offload."""
    c, theirs = candidate.config, candidate.layout.mesh
    changed = sum(getattr(theirs, key) != getattr(mesh, key) for key in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))
    changed += c.data.micro_batch != config.data.micro_batch
    changed += (c.train.recompute, c.train.recompute_layers) != (config.train.recompute, config.train.recompute_layers)
    changed += c.parallel.cpu_offload != config.parallel.cpu_offload
    changed += c.parallel.fsdp_reshard_after_forward != config.parallel.fsdp_reshard_after_forward
    changed += c.parallel.dp_mode != config.parallel.dp_mode
    return changed


def out_of_memory_report(layout: RunLayout, rank: int, error: BaseException) -> str:
    """A few lines: the error, this rank's predicted peak and breakdown, the nearest layout that fits."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    config, world_size = layout.config, layout.world_size
    limit = gpu_memory_gb(config)
    lines = [f"rank {rank} ran out of GPU memory ({first_line[:160]})"]
    try:
        predicted = memory.predict(layout, rank)
        lines.append(f"  predicted for this rank: {predicted.lines()[0].replace(' GB at', f' of {limit:g} GB at', 1)}")
        target = target_of(config, world_size)
        nearest = nearest_fit(layout, target)
    except UserError as planner_error:
        lines.append(f"  the planner cannot say more: {planner_error}")
        return "\n".join(lines)
    if nearest is None:
        lines.append(f"  {nothing_fits(target)}")
        return "\n".join(lines)
    lines.append(f"  nearest layout that fits: {summary(nearest)}")
    fp8 = "".join(f" {flag}" for flag in fp8_flags(target))
    lines.append(f"  python -m dtrain.planner --model {target.model} --gpus {world_size} --gpu-memory-gb {limit:g} "
                 f"--seq-len {target.seq_len} --global-batch {target.global_batch}{fp8} lists the fastest")
    return "\n".join(lines)
