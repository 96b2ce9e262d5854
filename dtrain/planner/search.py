"""The planner: every layout of a model on a number of GPUs, the ones that fit, the fastest first.

    from dtrain.planner.search import Target, search
    target = Target(model="llama3-70b", gpus=128, gpu_memory_gb=80, seq_len=8192, global_batch=1024)
    best = search(target)[:3]         # Candidates: mesh, micro-batch, recompute, memory, tokens/s
    print(best[0].command)

It enumerates tp (within a node), cp, pp with its schedule and virtual stages, ep for MoE models,
dp_shard and dp_replicate, the micro-batch, the recompute mode (none, selective, full, or full on
some blocks per stage), FSDP's resharding and CPU offload; keeps the candidates whose predicted
peak (memory.py, the largest over the ranks) fits the GPU; and sorts them by predicted tokens/s
per GPU (steptime.py). Each mesh's workload is built once and its variants derived from it, so a
1,024-GPU search takes seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs

from dtrain.config import Config, DataArgs, ModelArgs, ParallelArgs, TrainArgs
from dtrain.planner import memory, steptime
from dtrain.planner.hardware import GIGA, H200, Hardware
from dtrain.planner.workload import Workload, workload
from models.config import MoEConfig
from models.errors import UserError
from models.presets import get_model_config

SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4))
MICRO_BATCHES = (1, 2, 4, 8, 16)
# (--recompute, share of each stage's blocks under full recompute: --recompute-layers)
RECOMPUTE = (("none", 0.0), ("selective", 0.0), ("none", 0.5), ("selective", 0.5), ("full", 0.0))


@attrs.frozen
class Target:
    """What the user wants to run, and on what."""

    model: str
    gpus: int
    seq_len: int
    global_batch: int
    gpu_memory_gb: float = 80.0
    gpus_per_node: int = 8
    model_overrides: str = ""
    fp8: str | None = None
    fp8_backend: str = "torchao"
    fp8_head: bool = False
    fp8_experts: bool = False
    loss_chunk_tokens: int = 0
    compile: bool = True
    precision: str = "bf16"
    inter_node_gb_s: float = H200.inter_node_gb_s
    host_memory_gb: float = H200.host_memory_gb

    @property
    def hardware(self) -> Hardware:
        return attrs.evolve(H200, gpu_memory_gb=self.gpu_memory_gb, gpus_per_node=self.gpus_per_node,
                            inter_node_gb_s=self.inter_node_gb_s, host_memory_gb=self.host_memory_gb)


@attrs.frozen
class Candidate:
    config: Config
    memory: memory.MemoryBreakdown   # the rank with the largest peak
    step: steptime.StepTime
    gpus: int
    gpus_per_node: int

    @property
    def mesh(self) -> str:
        return self.config.parallel.mesh

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.step.tokens_per_sec_per_gpu

    @property
    def recompute(self) -> str:
        layers = self.config.train.recompute_layers
        return self.config.train.recompute + (f" + full on {layers} blocks/stage" if layers else "")

    @property
    def command(self) -> str:
        nodes = max(1, self.gpus // self.gpus_per_node)
        per_node = min(self.gpus, self.gpus_per_node)
        launch = f"torchrun --nnodes {nodes} --nproc_per_node {per_node}" + (
            " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500" if nodes > 1 else "")
        return f"{launch} -m dtrain.run {' '.join(run_flags(self.config))}"

    def as_json(self) -> dict:
        p, t = self.config.parallel, self.config.train
        return {
            "mesh": self.mesh, "micro_batch": self.config.data.micro_batch, "recompute": t.recompute,
            "recompute_layers": t.recompute_layers, "cpu_offload": p.cpu_offload, "sequence_parallel": p.sequence_parallel,
            "pp_schedule": p.pp_schedule if "pp=" in self.mesh else None,
            "pp_virtual_stages": p.pp_virtual_stages, "fsdp_reshard_after_forward": p.fsdp_reshard_after_forward,
            "memory_gb": round(self.memory.total / GIGA, 2), "memory_breakdown_gb": self.memory.as_gb(),
            "tokens_per_sec_per_gpu": round(self.tokens_per_sec_per_gpu, 1), "mfu": round(self.step.mfu(), 4),
            "step_seconds": round(self.step.seconds, 4), "command": self.command,
        }


def fp8_flags(settings: TrainArgs | Target) -> list[str]:
    """The dtrain.run flags of the FP8 settings (`fp8`, `fp8_backend`, `fp8_head`, `fp8_experts`) of
    a run or a planner target: none without a recipe."""
    if settings.fp8 is None:
        return []
    backend = ["--fp8-backend", settings.fp8_backend] if settings.fp8_backend != "torchao" else []
    return ["--fp8", settings.fp8, *backend, *(["--fp8-head"] if settings.fp8_head else []),
            *(["--fp8-experts"] if settings.fp8_experts else [])]


def run_flags(config: Config) -> list[str]:
    """The dtrain.run flags of a candidate: the model and data shape, the layout it chose."""
    m, p, d, t = config.model, config.parallel, config.data, config.train
    flags = ["--model", m.model, *(["--model-overrides", m.model_overrides] if m.model_overrides else []),
             "--mesh", p.mesh, "--seq-len", str(d.seq_len), "--global-batch", str(d.global_batch),
             "--micro-batch", str(d.micro_batch)]
    if t.compile:
        flags.append("--compile")
    if t.precision != "bf16":
        flags += ["--precision", t.precision]
    if p.sequence_parallel:
        flags.append("--sequence-parallel")
    if "pp=" in p.mesh:
        flags += ["--pp-schedule", p.pp_schedule] + (["--pp-virtual-stages", str(p.pp_virtual_stages)]
                                                       if p.pp_virtual_stages > 1 else [])
    if t.recompute != "none":
        flags += ["--recompute", t.recompute]
    if t.recompute_layers:
        flags += ["--recompute-layers", str(t.recompute_layers)]
    if p.fsdp_reshard_after_forward != "default":
        flags += ["--fsdp-reshard-after-forward", p.fsdp_reshard_after_forward]
    if p.cpu_offload:
        flags.append("--cpu-offload")
    flags += fp8_flags(t)
    if t.loss_chunk_tokens:
        flags += ["--loss-chunk-tokens", str(t.loss_chunk_tokens)]
    return flags


def search(target: Target) -> list[Candidate]:
    """The candidates that fit, fastest first."""
    hw = target.hardware
    found = []
    for base in _meshes(target):
        found += _fitting_variants(target, base, hw)
    return sorted(found, key=lambda c: (-c.tokens_per_sec_per_gpu, c.memory.total))


def _fitting_variants(target: Target, base: dict, hw: Hardware) -> list[Candidate]:
    """For each micro-batch and resharding choice of a mesh, the first recompute choice that fits
    (the ones after it only recompute more); CPU offload only where nothing fits without it. A
    micro-batch that fits in no way ends the larger ones. Memory is predicted first, the first
    pipeline rank before the last: most variants of a large model do not fit, and are not timed."""
    budget, host_budget = hw.gpu_memory_bytes, hw.host_bytes_per_gpu
    for offload in (False, True):
        found = []
        for reshard in ("default", "never") if base["pp"] == 1 and base["dp"] > 1 else ("default",):
            for micro_batch in _micro_batches(target, base):
                fits = None
                for mode, layers in _recompute_choices(base):
                    config = _variant(base["config"], micro_batch, reshard, mode, layers, offload)
                    peaks = []
                    for work in base["works"]:
                        peaks.append(memory.predict_workload(_derive(work, config)))
                        if peaks[-1].total > budget or peaks[-1].host > host_budget:
                            break
                    else:
                        fits = config, max(peaks, key=lambda b: b.total)
                        break
                if fits is None:
                    break
                config, peak = fits
                step = max((steptime.predict_workload(_derive(w, config), hw) for w in base["works"]),
                           key=lambda s: s.seconds)
                found.append(Candidate(config, peak, step, target.gpus, target.gpus_per_node))
        if found:
            return found
    return []


def _derive(work: Workload, config: Config) -> Workload:
    """The workload of a mesh under another micro-batch, recompute or offload choice."""
    d = config.data
    return attrs.evolve(work, config=config, tokens=d.micro_batch * d.seq_len // work.mesh_spec.cp,
                        num_microbatches=d.global_batch // (d.micro_batch * work.mesh_spec.dp_size))


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [k for k in range(1, (limit or n) + 1) if n % k == 0]


def _meshes(target: Target) -> Iterator[dict]:
    """Every valid mesh and pipeline schedule, with the workloads of its first and last pipeline rank."""
    cfg = get_model_config(target.model, target.model_overrides)
    is_moe = isinstance(cfg, MoEConfig)
    gpus, seq = target.gpus, target.seq_len
    for tp in _divisors(gpus, min(gpus, target.gpus_per_node)):
        if cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads) or (is_moe and seq % tp):
            continue
        for cp in _divisors(gpus // tp):
            if cp > 1 and (seq % (2 * cp) or seq // cp < 1024):
                continue
            for pp in _divisors(gpus // (tp * cp), min(cfg.num_layers, gpus // (tp * cp))):
                dp = gpus // (tp * cp * pp)
                if target.global_batch % dp:
                    continue
                for dp_replicate in _replicas(dp):
                    for ep in (_divisors(cfg.num_experts) if is_moe else [1]):
                        if (dp // dp_replicate * cp) % ep:
                            continue
                        for schedule, virtual in (SCHEDULES if pp > 1 else (("1f1b", 1),)):
                            if pp * virtual > cfg.num_layers:
                                continue
                            yield from _mesh(target, tp, cp, pp, dp_replicate, dp // dp_replicate, ep, schedule, virtual)


def _replicas(dp: int) -> list[int]:
    """HSDP replica counts worth trying: none, and powers of two that leave >= 8 shards."""
    return [1] + [r for r in (2, 4, 8, 16, 32, 64, 128) if dp % r == 0 and dp // r >= 8]


def _mesh(target: Target, tp, cp, pp, dp_replicate, dp_shard, ep, schedule, virtual) -> Iterator[dict]:
    sizes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "ep": ep}
    mesh = ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "dp_shard=1"
    config = Config(
        model=ModelArgs(target.model, target.model_overrides),
        parallel=ParallelArgs(mesh=mesh, sequence_parallel=tp > 1, pp_schedule=schedule, pp_virtual_stages=virtual),
        data=DataArgs(data="synthetic", seq_len=target.seq_len, micro_batch=1, global_batch=target.global_batch),
        train=TrainArgs(compile=target.compile, fp8=target.fp8, fp8_backend=target.fp8_backend,
                        fp8_head=target.fp8_head, fp8_experts=target.fp8_experts, precision=target.precision,
                        loss_chunk_tokens=target.loss_chunk_tokens),
    )
    try:
        works = [workload(config, target.gpus, rank) for rank in {0, target.gpus - 1}]
    except UserError:
        return
    yield {"config": config, "works": works, "pp": pp, "dp": dp_replicate * dp_shard}


def _micro_batches(target: Target, base: dict) -> Iterator[int]:
    """Micro-batches the global batch and the pipeline schedule allow, smallest first."""
    pp, dp, virtual = base["pp"], base["dp"], base["config"].parallel.pp_virtual_stages
    for micro_batch in MICRO_BATCHES:
        if target.global_batch % (micro_batch * dp):
            continue
        micro_batches = target.global_batch // (micro_batch * dp)
        if pp > 1 and (micro_batches < pp or (virtual > 1 and micro_batches % pp)):
            continue
        yield micro_batch


def _recompute_choices(base: dict) -> list[tuple[str, int]]:
    """From the least recompute to the most: none, selective, full on half of each stage's
    blocks (with none or selective on the rest), full."""
    blocks = max(base["works"][0].counts)
    return [(mode, math.ceil(blocks * share)) for mode, share in RECOMPUTE]


def _variant(config: Config, micro_batch: int, reshard: str, mode: str, layers: int, offload: bool) -> Config:
    return attrs.evolve(config, data=attrs.evolve(config.data, micro_batch=micro_batch),
                        train=attrs.evolve(config.train, recompute=mode, recompute_layers=layers),
                        parallel=attrs.evolve(config.parallel, fsdp_reshard_after_forward=reshard, cpu_offload=offload))


def minimum_memory(target: Target) -> dict[bool, float]:
    """The smallest predicted peak over every layout, without and with CPU offload (where host
    memory holds what it moves): one sample per micro-batch, full recompute."""
    lowest = {False: math.inf, True: math.inf}
    for base in _meshes(target):
        config = base["config"]
        dp = base["dp"]
        if target.global_batch % dp or (base["pp"] > 1 and target.global_batch // dp < base["pp"]):
            continue
        config = attrs.evolve(config, train=attrs.evolve(config.train, recompute="full"))
        for offload in (False, True):
            config = attrs.evolve(config, parallel=attrs.evolve(config.parallel, cpu_offload=offload))
            peaks = [memory.predict_workload(_derive(w, config)) for w in base["works"]]
            if max(b.host for b in peaks) <= target.hardware.host_bytes_per_gpu:
                lowest[offload] = min(lowest[offload], max(b.total for b in peaks))
    return lowest


def _fits(target: Target) -> bool | None:
    """False where some layout fits without CPU offload, True where only offloaded ones do, None
    where none does."""
    lowest = minimum_memory(target)
    budget = target.gpu_memory_gb * GIGA
    return False if lowest[False] <= budget else True if lowest[True] <= budget else None


def nothing_fits(target: Target) -> str:
    """One line for a model that fits nowhere: the nearest GPU count, sequence length and
    precision at which something fits (and whether only with CPU offload)."""
    what = (f"{target.model} at --seq-len {target.seq_len} and --global-batch {target.global_batch} does not fit "
            f"on {target.gpus} GPUs of {target.gpu_memory_gb:g} GB with any mesh, micro-batch, recompute or CPU offload")
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
