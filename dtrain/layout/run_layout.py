"""`RunLayout`: everything a run decides before it starts, as one frozen value.

    layout = resolve(config, world_size=64, machine=Machine.detect())
    layout.mesh.fsdp_dims, layout.plan, layout.pipeline.blocks_per_stage, layout.parallel.fsdp.resharded
    json.dumps(layout.to_dict())          # what `--print-plan --json` prints

The trainer, the model build, the checkpoints, the planner, the dry run and `--print-plan` all
read it; none of them reads an option to decide something again.
"""

from __future__ import annotations

import functools

import attrs

from dtrain.config import Config
from dtrain.layout.machine import Machine
from models import families, spec
from parallel.layout import ParallelLayout, PipelineLayout
from parallel.mesh import MeshSpec
from parallel.plan import Plan


@attrs.frozen
class Choice:
    """An option its user left unset, as the run chose it (dtrain/layout/defaults.py), and why: a
    sentence the run, the dry run and `--print-plan` print."""

    option: str     # the config field: micro_batch, fsdp_reshard_after_forward
    value: object
    reason: str

    def line(self) -> str:
        return f"--{self.option.replace('_', '-')} {self.value}: {self.reason}"


@attrs.frozen
class RunLayout:
    """A run, resolved. `config` is the options as resolved (--global-batch filled in); the
    decisions are the other fields: the mesh and each role's dims (`mesh`, MeshSpec's `*_dims`),
    the pipeline split and schedule (`pipeline`), and how the model is laid out and run on the
    mesh (`parallel`: the sharding plan, kernels, FP8, recompute, FSDP per unit). `chosen`: the
    options left unset that the run chose for its GPU, with their reasons."""

    config: Config
    machine: Machine
    model_cfg: families.ModelConfig
    mesh: MeshSpec
    pipeline: PipelineLayout
    parallel: ParallelLayout
    # Why the unset options hold their values: not a decision of its own (layouts equal without it).
    chosen: tuple[Choice, ...] = attrs.field(default=(), eq=False)

    @property
    def plan(self) -> Plan:
        return self.parallel.plan

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.pipeline.num_microbatches

    @property
    def tokens_per_micro_batch(self) -> int:
        """The tokens of one micro-batch on one rank (its cp chunks of each sequence)."""
        d = self.config.data
        return d.micro_batch * d.seq_len // self.mesh.cp

    @property
    def global_tokens(self) -> int:
        d = self.config.data
        return d.global_batch * d.seq_len

    @property
    def loss_scale(self) -> float:
        """Each rank's summed loss is scaled so that FSDP's average over the dp ranks yields the
        gradient of the mean loss over the whole global batch; with cp, FSDP also averages over
        the cp ranks, which each hold 1/cp of every sample."""
        return self.mesh.dp_size * self.mesh.cp / self.global_tokens

    @property
    def layers(self) -> list[spec.Layer]:
        """The model's layer sequence (shared: do not change it)."""
        return _layers(self.model_cfg)

    def to_dict(self) -> dict:
        """The decisions as plain JSON values (`--print-plan --json`)."""
        c, p, par = self.config, self.config.parallel, self.parallel
        return {
            "model": {"name": c.model.model, "config": {"family": type(self.model_cfg).__name__,
                                                        **attrs.asdict(self.model_cfg)}},
            "machine": self.machine.to_dict(),
            "world_size": self.world_size,
            "mesh": {"text": str(self.mesh), "sizes": {**self.mesh.sizes(), "ep": self.mesh.ep},
                     "roles": self.mesh.roles()},
            "plan": {"parameters": _rules(par.plan.param_rules),
                     "activations": {region: _rules(rules) for region, rules in par.plan.activation_rules.items()},
                     "sequence_parallel": par.plan.sequence_parallel},
            "batch": {"seq_len": c.data.seq_len, "micro_batch": c.data.micro_batch,
                      "global_batch": c.data.global_batch, "tokens_per_micro_batch": self.tokens_per_micro_batch},
            "pipeline": self.pipeline.to_dict(),
            "precision": par.precision,
            "compile": par.compile,
            "attention": {"request": par.attention_kernel, "masked": self.masked_attention_kernels()},
            "cp_comm": par.cp_comm if self.mesh.cp > 1 else None,
            "ep_dispatch": par.ep_dispatch,
            "tp_overlap": par.tp_overlap,
            "async_tp": par.async_tp,
            "fp8": par.fp8.to_dict() if par.fp8 is not None else None,
            "fp8_experts": par.fp8_experts.to_dict() if par.fp8_experts is not None else None,
            "recompute": {"mode": par.recompute,
                          "full": sorted(par.full_recompute, key=lambda n: int(n.split(".")[1]))},
            "fsdp": par.fsdp.to_dict(),
            "fuse_projections": par.fuse_projections,
            "loss_chunk_tokens": par.loss_chunk_tokens,
            "gpu_memory_gb": p.gpu_memory_gb or None,
            "chosen": [attrs.asdict(choice) for choice in self.chosen],
        }

    def masked_attention_kernels(self) -> dict[str, str]:
        """The kernel of each kind of masked attention this run has (none: plain causal attention)."""
        cfg, par = self.model_cfg, self.parallel
        whole_row = self.mesh.cp == 1 or par.cp_comm == "a2a"
        sinks = bool(getattr(cfg, "attention_sinks", False))
        kinds = {}
        if self.config.data.document_mask:
            kinds["documents"] = False
        if any(kind != "full" for kind in cfg.layer_kinds):
            kinds["windows or chunks"] = True
        return {name: par.masked_kernels[(whole_row, windowed, sinks)] for name, windowed in kinds.items()}


@functools.lru_cache(maxsize=16)
def _layers(model_cfg) -> list[spec.Layer]:
    return families.layers(model_cfg)


def _rules(rules) -> dict:
    return {axis: list(mapped) if isinstance(mapped, tuple) else mapped for axis, mapped in rules.items()}
