"""How a run lays its model out and runs it: the decisions `parallelize`, the model context and
the pipeline read, made once before anything is built. `dtrain.layout.resolve` makes them from a
run's options; a test makes them by hand:

    layout = ParallelLayout(Plan.build(mesh_spec, sequence_parallel=True), tp_overlap="chunked")
    model = parallelize(layers, layout, build_meshes(mesh_spec, "cpu"), device=torch.device("cpu"))

Values only (names, numbers, frozensets): the process groups come from the meshes at run time.
"""

from __future__ import annotations

import attrs
import torch

from parallel import masked_attention, pipeline
from parallel.plan import Plan

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@attrs.frozen
class FP8Layout:
    """Which matmuls run in FP8, and how."""

    recipe: str
    backend: str = "torchao"
    layers: frozenset[str] = frozenset()  # the blocks whose matmuls run in FP8 (`blocks.3`)
    head: bool = False                    # the output projection too
    # FSDP all-gathers the FP8 blocks' matmul weights in float8; else why not (precision.py).
    all_gather: bool = False
    all_gather_blocker: str | None = None
    amax_history: int = 1024              # Transformer Engine's delayed scaling
    emulated: bool = True                 # torchao's casts emulated: no FP8 GEMMs on this machine

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "backend": self.backend, "layers": sorted(self.layers, key=_layer_order),
                "head": self.head, "all_gather": self.all_gather,
                "all_gather_blocker": self.all_gather_blocker}


@attrs.frozen
class FP8ExpertsLayout:
    """The routed experts' grouped GEMMs in FP8 (--fp8-experts): torchao's rowwise-scaled ones
    (parallel/fp8_experts.py), with or without FP8 for the other matmuls, or Transformer Engine's
    beside its FP8 matmuls (parallel/te_experts.py)."""

    backend: str = "torchao"              # "torchao" or "te"
    layers: frozenset[str] = frozenset()  # the blocks whose routed experts run in FP8 (`blocks.3`)
    emulated: bool = True                 # torchao's casts emulated: no FP8 grouped GEMM on this machine

    def to_dict(self) -> dict:
        return {"backend": self.backend, "layers": sorted(self.layers, key=_layer_order), "emulated": self.emulated}


@attrs.frozen
class FSDPLayout:
    """What data parallelism does with each FSDP unit: which units free their gathered parameters
    after forward, and which sum their gradients whole over a step's micro-batches and reduce them
    once after the last."""

    dp_mode: str = "fsdp"
    resharded: frozenset[str] = frozenset()  # units freed after forward: `blocks.3`, `mtp`, `embed`
    # Every unit reduces once (pipelining, --fsdp-reduce-once, ZeRO-1); else those of one shard do
    # unless CPU offload keeps their shards in host memory (`reduces_once`).
    reduce_once: bool = False
    cpu_offload: bool = False

    def reduces_once(self, shards: int) -> bool:
        """Whether a unit split over `shards` ranks reduces its gradients once per step: with one
        shard the whole fp32 gradients take the memory the fp32 shards would, and reducing after
        every micro-batch would only cost time."""
        return self.reduce_once or (shards == 1 and not self.cpu_offload)

    def to_dict(self) -> dict:
        return {"dp_mode": self.dp_mode, "resharded": sorted(self.resharded, key=_layer_order),
                "reduce_once": "every unit" if self.reduce_once else
                ("units of one shard" if not self.cpu_offload else "none"), "cpu_offload": self.cpu_offload}


@attrs.frozen
class ParallelLayout:
    """The decisions that lay a model out on the mesh and run its layers there."""

    plan: Plan
    precision: str = "fp32"               # compute dtype (master weights and reductions stay fp32)
    seed: int = 0                         # of the mesh-independent initial values
    compile: bool = False                 # each block and the head (and the experts, loss chunks) compiled
    async_tp: bool = False                # inductor fuses tp's collectives with their matmuls
    tp_overlap: str | None = None         # "symm_mem" or "chunked" where the plan overlaps tp, else None
    cp_comm: str = "allgather"
    ep_dispatch: str | None = None        # "alltoall" or "allgather" with ep > 1
    # Masked attention's kernel as asked (auto, flex, varlen, dense); each site's is the rule of
    # parallel/masked_attention.py on this request.
    attention_kernel: str = "auto"
    # ... and the kernel of each kind of site: (whole row, windowed, with log-sum-exp) -> kernel.
    masked_kernels: dict = attrs.field(
        default=attrs.Factory(lambda self: masked_attention.kernels(self.attention_kernel, "cpu", self.compute_dtype),
                              takes_self=True))
    recompute: str = "none"               # the blocks' mode ...
    full_recompute: frozenset[str] = frozenset()  # ... but these blocks recompute in full
    fp8: FP8Layout | None = None
    fp8_experts: FP8ExpertsLayout | None = None
    fuse_projections: bool = False
    loss_chunk_tokens: int = 0
    fsdp: FSDPLayout = FSDPLayout()

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.precision]

    def masked_kernel(self, whole_row: bool, window: int | None, with_lse: bool) -> str:
        return self.masked_kernels[(whole_row, window is not None, with_lse)]

    @property
    def fp8_layers(self) -> frozenset[str]:
        return self.fp8.layers if self.fp8 is not None else frozenset()

    def recompute_of(self, layer_name: str) -> str:
        """The recompute mode of a transformer layer (`blocks.3`, `mtp`)."""
        return "full" if layer_name in self.full_recompute else self.recompute


@attrs.frozen
class PipelineLayout:
    """The pipeline split and schedule: `blocks_per_stage` over all pp x virtual stages
    ((num_layers,) when pp=1), and the micro-batches each data-parallel rank runs per step."""

    pp: int
    schedule: str
    virtual_stages: int
    blocks_per_stage: tuple[int, ...]
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.blocks_per_stage)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs, in order ([0] when pp=1)."""
        if self.pp == 1:
            return [0]
        return pipeline.stage_ids(pp_rank, self.pp, self.virtual_stages, self.schedule)

    def to_dict(self) -> dict:
        return {"schedule": self.schedule if self.pp > 1 else None, "virtual_stages": self.virtual_stages,
                "blocks_per_stage": list(self.blocks_per_stage), "num_microbatches": self.num_microbatches,
                "stages_of_pp_rank": {r: self.stage_ids(r) for r in range(self.pp)} if self.pp > 1 else None}


def _layer_order(name: str) -> tuple:
    """`embed`, `blocks.0`, `blocks.1`, ..., then the rest by name."""
    kind, _, index = name.partition(".")
    return ({"embed": 0, "blocks": 1}.get(kind, 2), int(index) if index.isdigit() else 0, name)
