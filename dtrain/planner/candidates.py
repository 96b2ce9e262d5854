"""What the planner is asked (a Target: the model, the data shape, the GPUs, and the choices the
user fixed) and what it answers (Candidates: a layout, its memory per rank and its step time,
and the command that runs it)."""

from __future__ import annotations

import attrs

from dtrain.config import Config, TrainArgs
from dtrain.launch import local
from dtrain.layout import Machine, RunLayout
from dtrain.planner import gpus, memory, steptime
from dtrain.planner.hardware import GIGA, H200, Hardware


@attrs.frozen
class Fixed:
    """Choices of the layout the user gave (None: searched). `mesh` fixes every mesh size."""

    mesh: str | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    recompute_layers: int | None = None
    pp_schedule: str | None = None
    pp_virtual_stages: int | None = None
    fsdp_reshard_after_forward: str | None = None
    cpu_offload: bool | None = None
    dp_mode: str | None = None

    def allows(self, name: str, value) -> bool:
        fixed = getattr(self, name)
        return fixed is None or fixed == value


@attrs.frozen
class Target:
    """What the user wants to run, and on what: GPU `gpu` (a profile of gpus.py) with its
    memory and network unless `gpu_memory_gb` and `inter_node_gb_s` say otherwise."""

    model: str
    gpus: int
    seq_len: int
    global_batch: int
    gpu: str = gpus.DEFAULT
    gpu_memory_gb: float | None = None
    gpus_per_node: int = 8
    model_overrides: str = ""
    fp8: str | None = None
    fp8_backend: str = "torchao"
    fp8_head: bool = False
    fp8_experts: bool = False
    loss_chunk_tokens: int = 0
    compile: bool = True
    precision: str = "bf16"
    inter_node_gb_s: float | None = None
    host_memory_gb: float = H200.host_memory_gb
    fixed: Fixed = Fixed()

    @property
    def machine(self) -> Machine:
        """The machine the layouts are resolved for: GPUs of this profile."""
        return Machine.gpu_profile(self.gpu)

    @property
    def hardware(self) -> Hardware:
        return gpus.profile(self.gpu, memory_gb=self.gpu_memory_gb, inter_node_gb_s=self.inter_node_gb_s,
                            gpus_per_node=self.gpus_per_node, host_memory_gb=self.host_memory_gb)

    @property
    def memory_gb(self) -> float:
        return self.gpu_memory_gb or gpus.DATASHEETS[self.gpu].memory_gb


@attrs.frozen
class Candidate:
    layout: RunLayout
    memory: memory.MemoryBreakdown   # the rank with the largest peak
    step: steptime.StepTime
    gpus: int
    gpus_per_node: int
    gpu: str = gpus.DEFAULT
    fits: bool = True                # False only for a fixed layout that fits in no way

    @property
    def config(self) -> Config:
        return self.layout.config

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
        flags = " ".join(run_flags(self.config))
        if nodes > 1:
            return (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} --rdzv-backend c10d --rdzv-endpoint "
                    f"$HEAD_NODE:29500 -m dtrain.run {flags}")
        return f"{local.command(per_node)} {flags}"

    def as_json(self) -> dict:
        p, t = self.config.parallel, self.config.train
        return {
            "mesh": self.mesh, "micro_batch": self.config.data.micro_batch, "recompute": t.recompute,
            "recompute_layers": t.recompute_layers, "cpu_offload": p.cpu_offload, "sequence_parallel": p.sequence_parallel,
            "pp_schedule": p.pp_schedule if "pp=" in self.mesh else None,
            "pp_virtual_stages": p.pp_virtual_stages, "fsdp_reshard_after_forward": p.fsdp_reshard_after_forward,
            "dp_mode": p.dp_mode, "fits": self.fits, "gpu": self.gpu,
            "memory_gb": round(self.memory.total / GIGA, 2), "memory_breakdown_gb": self.memory.as_gb(),
            "tokens_per_sec_per_gpu": round(self.tokens_per_sec_per_gpu, 1), "mfu": round(self.step.mfu(), 4),
            "step_seconds": round(self.step.seconds, 4), "step_breakdown_s": self.step.breakdown(),
            "bound_by": self.step.bound_by(), "command": self.command,
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
    if p.dp_mode != "fsdp":
        flags += ["--dp-mode", p.dp_mode]
    elif p.fsdp_reshard_after_forward != "default":
        flags += ["--fsdp-reshard-after-forward", p.fsdp_reshard_after_forward]
    if p.cpu_offload:
        flags.append("--cpu-offload")
    flags += fp8_flags(t)
    if t.loss_chunk_tokens:
        flags += ["--loss-chunk-tokens", str(t.loss_chunk_tokens)]
    return flags
