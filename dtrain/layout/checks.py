"""Every check of a run's configuration that needs no memory, so that a bad input fails in one line
before any work is done, and the sharding plan the checked configuration resolves to."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import attrs
import torch

from dtrain import rank_model
from dtrain.config import Config
from dtrain.data import validate_data_args
from models.config import DeepSeekConfig, LlamaConfig, MoEConfig
from models.errors import UserError
from models.linear_cross_entropy import check_chunk_tokens
from models.presets import get_model_config
from parallel import pipeline, precision, recompute
from parallel.data_parallel import fsdp_settings
from parallel.mesh import MeshSpec
from parallel.plan import Plan

logger = logging.getLogger("dtrain")

# Micro-batches per step per pipeline stage when --global-batch is not given (see with_global_batch).
DEFAULT_MICROBATCHES_PER_STAGE = 2

MAX_TIMEOUT_S = 7 * 24 * 3600.0


def validate(config: Config, world_size: int) -> tuple[MeshSpec, LlamaConfig]:
    """Every check that needs no memory, so a bad input fails before any work is done."""
    model_cfg = get_model_config(config.model.model, config.model.model_overrides)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    _check_sizes(config)
    _check_model_split(config, model_cfg, mesh_spec)
    _check_sequence_split(config, model_cfg, mesh_spec)
    _check_options(config, model_cfg, mesh_spec)
    recompute.validate_partial(config.train.recompute_layers, config.train.recompute,
                               rank_model.blocks_per_stage(config, model_cfg, mesh_spec))
    validate_data_args(config.data.data, config.data.tokenizer, config.data.split,
                       config.data.synthetic_document_length)
    return mesh_spec, model_cfg


def _check_sizes(config: Config) -> None:
    d, t = config.data, config.train
    for name, value in (("--seq-len", d.seq_len), ("--micro-batch", d.micro_batch),
                        ("--global-batch", d.global_batch), ("--steps", t.steps)):
        if value < 1:
            raise UserError(f"{name} {value} must be >= 1")
    for name, value in (("--checkpoint-every", t.checkpoint_every), ("--keep-last", t.keep_last),
                        ("--log-every", t.log_every),
                        ("--eval-every", t.eval_every), ("--straggler-every", t.straggler_every)):
        if value < 0:
            raise UserError(f"{name} {value} must be >= 0")
    # A collective's timeout is a timedelta: no NaN, no infinity (a week is a timeout too).
    if not (0 < t.init_timeout <= MAX_TIMEOUT_S and 0 <= t.step_timeout <= MAX_TIMEOUT_S):
        raise UserError(f"--init-timeout {t.init_timeout} and --step-timeout {t.step_timeout} must be seconds in "
                        f"(0, {MAX_TIMEOUT_S:g}] and [0, {MAX_TIMEOUT_S:g}] (--step-timeout 0: no hang detection)")
    if t.max_skipped_steps < 1 or t.spike_window < 1 or t.skip_spikes < 0 or 0 < t.skip_spikes <= 1:
        raise UserError(f"--max-skipped-steps {t.max_skipped_steps} and --spike-window {t.spike_window} must be >= 1, "
                        f"--skip-spikes {t.skip_spikes} 0 (off) or above 1 (a factor of the median loss)")
    if config.optim.warmup_steps < 0:
        raise UserError(f"--warmup-steps {config.optim.warmup_steps} must be >= 0")
    _check_optimizer(config.optim)


def _check_optimizer(o) -> None:
    """The optimizer's and schedule's numbers, before torch's own checks (or none: a NaN or a
    negative clipping threshold) would meet them mid-setup."""
    checks = {"--lr": (o.lr, o.lr > 0, "> 0"),
              "--min-lr-ratio": (o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
              "--decay-fraction": (o.decay_fraction, 0 <= o.decay_fraction <= 1, "in [0, 1]"),
              "--weight-decay": (o.weight_decay, o.weight_decay >= 0, ">= 0"),
              "--beta1": (o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
              "--beta2": (o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
              "--eps": (o.eps, o.eps > 0, "> 0"),
              "--grad-clip": (o.grad_clip, o.grad_clip >= 0, ">= 0 (0: no clipping)")}
    for flag, (value, in_range, wanted) in checks.items():
        if not (in_range and math.isfinite(value)):  # NaN fails every comparison
            raise UserError(f"{flag} {value} must be a finite number {wanted}")


def check_mesh_split(config: Config, world_size: int) -> None:
    """The checks of the mesh and schedule that do not depend on the batch (heads over tp, experts
    over ep, layers over pipeline stages, the sequence over cp): what the planner checks of a
    mesh it is given before it searches the batch's split."""
    model_cfg = get_model_config(config.model.model, config.model.model_overrides)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    # One micro-batch of one sample, pp of them per rank: a batch that every schedule takes.
    batch = attrs.evolve(config.data, micro_batch=1, global_batch=mesh_spec.dp_size * mesh_spec.pp)
    _check_model_split(attrs.evolve(config, data=batch), model_cfg, mesh_spec)
    _check_sequence_split(config, model_cfg, mesh_spec)


def _check_model_split(config: Config, model_cfg, mesh_spec: MeshSpec) -> None:
    """Heads over tp, experts over ep, layers over pipeline stages, rows over data-parallel ranks."""
    name, d = config.model.model, config.data
    tp, heads, kv_heads = mesh_spec.tp, model_cfg.num_heads, model_cfg.num_kv_heads
    if heads % tp:
        raise UserError(f"model {name} has num_heads={heads}, not divisible by tp={tp}; choose a tp that divides {heads}")
    if kv_heads % tp and tp % kv_heads:
        raise UserError(f"model {name} has num_kv_heads={kv_heads} and tp={tp}: one must divide the other (KV heads "
                        f"are split, or replicated over groups of tp ranks); change tp")
    is_moe = isinstance(model_cfg, MoEConfig)
    if mesh_spec.ep > 1 and not is_moe:
        raise UserError(f"ep={mesh_spec.ep} needs a mixture-of-experts model; {name} is dense")
    if mesh_spec.ep > 1 and model_cfg.num_experts % mesh_spec.ep:
        raise UserError(f"model {name} has {model_cfg.num_experts} experts, not divisible by ep={mesh_spec.ep}; "
                        f"choose an ep that divides {model_cfg.num_experts}")
    if mesh_spec.ep > 1 and config.parallel.ep_dispatch == "allgather" and model_cfg.capacity_factor is not None:
        raise UserError(f"--ep-dispatch allgather sends every token to its experts and drops none; remove "
                        f"capacity_factor={model_cfg.capacity_factor} or use --ep-dispatch alltoall")
    if (mesh_spec.ep > 1 and config.parallel.ep_dispatch == "allgather" and model_cfg.scale_expert_inputs
            and model_cfg.top_k > 1):
        raise UserError(f"--ep-dispatch allgather sends each token once, but with scale_expert_inputs each of its "
                        f"top_k={model_cfg.top_k} experts sees it scaled by its own weight; use --ep-dispatch alltoall")
    if is_moe and tp > 1 and d.seq_len % tp:
        raise UserError(f"--seq-len {d.seq_len} is not divisible by tp={tp}: MoE layers split the tokens over tp; "
                        f"use a multiple of {tp}")
    per_step = d.micro_batch * mesh_spec.dp_size
    if d.global_batch % per_step:
        raise UserError(f"--global-batch {d.global_batch} is not divisible by --micro-batch {d.micro_batch} x "
                        f"data-parallel size {mesh_spec.dp_size} = {per_step}; make it a multiple of {per_step}")
    if mesh_spec.pp > 1:
        if model_cfg.tie_embeddings:
            raise UserError(f"model {name} ties its embedding and head, which pp={mesh_spec.pp} puts on different "
                            f"ranks; use --model-overrides tie_embeddings=false or pp=1")
        p = config.parallel
        pipeline.validate_schedule(p.pp_schedule, mesh_spec.pp, p.pp_virtual_stages,
                                   d.global_batch // per_step, model_cfg.num_layers, p.pp_layout,
                                   on_gpus=torch.cuda.is_available())


def _check_sequence_split(config: Config, model_cfg, mesh_spec: MeshSpec) -> None:
    """Context parallelism's chunks."""
    d, cp, tp = config.data, mesh_spec.cp, mesh_spec.tp
    if cp == 1:
        return
    if d.seq_len % (2 * cp):
        raise UserError(f"--seq-len {d.seq_len} is not divisible by 2 x cp = {2 * cp} (load-balanced context "
                        f"parallelism cuts each sequence into 2 x cp chunks); use a multiple of {2 * cp}")
    local_heads, local_kv = model_cfg.num_heads // tp, max(model_cfg.num_kv_heads // tp, 1)
    if config.parallel.cp_comm == "a2a" and (local_heads % cp or local_kv % cp):
        raise UserError(f"--cp-comm a2a splits heads over cp={cp}, but each tp rank has {local_heads} query "
                        f"and {local_kv} KV heads; use --cp-comm allgather or ring, or a cp dividing both")


def _check_options(config: Config, model_cfg, mesh_spec: MeshSpec) -> None:
    """Async TP and the tp overlap, FP8, and the checkpoint paths."""
    t, p, tp = config.train, config.parallel, mesh_spec.tp
    if p.async_tp and not (t.compile and p.sequence_parallel and tp > 1 and torch.cuda.is_available()):
        raise UserError("--async-tp needs --compile, --sequence-parallel, a mesh with tp > 1 and CUDA GPUs")
    fsdp_settings(p.dp_mode, p.fsdp_reshard_after_forward, p.fsdp_reduce_once)
    if p.dp_mode == "zero1" and p.cpu_offload:
        raise UserError("--dp-mode zero1 keeps the parameters whole on the GPU through the step, --cpu-offload keeps "
                        "them in host memory: drop one of them")
    if p.cpu_offload and t.fp8 == "tensorwise" and t.fp8_all_gather:
        raise UserError("--cpu-offload keeps the weights' shards in host memory, where the float8 all-gather's "
                        "scales cannot be computed; add --no-fp8-all-gather (the FP8 matmuls stay)")
    if rank_model.tp_overlap_method(config, mesh_spec) is not None and (config.data.seq_len // mesh_spec.cp) % tp:
        raise UserError(f"--tp-overlap splits each rank's {config.data.seq_len // mesh_spec.cp} tokens of a sequence "
                        f"into tp={tp} equal shards; use a --seq-len divisible by {tp * mesh_spec.cp}, or "
                        f"--tp-overlap none")
    check_head(t.fp8, t.fp8_head, t.loss_chunk_tokens)
    check_experts(t, model_cfg)
    if t.fp8 is not None:
        if t.precision != "bf16":
            raise UserError(f"--fp8 runs the other ops in bf16; use --precision bf16, not {t.precision}")
        if t.fp8_backend == "te" and t.fuse_projections:
            raise UserError("--fuse-projections does not apply to --fp8-backend te (each projection is its own "
                            "Transformer Engine matmul, with its own scales); drop one of them")
        if t.fp8_amax_history < 1:
            raise UserError(f"--fp8-amax-history {t.fp8_amax_history} must be >= 1")
        is_moe = isinstance(model_cfg, MoEConfig)
        # The rows of one matmul: a rank's micro-batch (its cp chunks); MoE layers split them over tp.
        tokens = config.data.micro_batch * config.data.seq_len // (mesh_spec.cp * (tp if is_moe else 1))
        precision.validate_fp8(t.fp8, t.fp8_backend, _matmul_widths(model_cfg, tp, t.fp8_head), tokens)
    run_dirs_own = ("latest", "auto")  # --resume of --run-dir's checkpoints, not a path
    for name, path in (("--resume", t.resume if t.resume not in run_dirs_own else None),
                       ("--init-from-hf", t.init_from_hf)):
        if path is not None and not Path(path).exists():
            raise UserError(f"{name} {path}: no such checkpoint directory")


def check_head(fp8: str | None, fp8_head: bool, loss_chunk_tokens: int) -> None:
    """The output projection's flags agree (the planner checks them too)."""
    if fp8_head and fp8 is None:
        raise UserError("--fp8-head runs the output projection in FP8; give --fp8 RECIPE with it")
    check_chunk_tokens(loss_chunk_tokens)
    if loss_chunk_tokens and fp8_head:
        raise UserError("--loss-chunk-tokens runs the output projection in bf16, a chunk at a time; --fp8-head runs "
                        "it in FP8 on all tokens at once: drop one of them")


def check_experts(settings, model_cfg) -> None:
    """`--fp8-experts` has TE's FP8 and routed experts to run (a run's train args or a planner
    target; the planner checks it too)."""
    if settings.fp8_experts and (settings.fp8 is None or settings.fp8_backend != "te"):
        raise UserError("--fp8-experts runs the routed experts in Transformer Engine's FP8 grouped GEMM; give "
                        "--fp8 RECIPE --fp8-backend te with it")
    if settings.fp8_experts and not isinstance(model_cfg, MoEConfig):
        raise UserError("--fp8-experts: this model has no routed experts; drop the flag")
    if settings.fp8_experts and (model_cfg.expert_bias or model_cfg.expert_glu is not None):
        raise UserError("--fp8-experts: Transformer Engine's FP8 experts run plain SwiGLU without biases, and this "
                        "model's experts have biases or gpt-oss's clamped unit; drop the flag (they run in bf16)")


def _matmul_widths(model_cfg, tp: int, head: bool) -> list[int]:
    """The widths of the blocks' matmul inputs and outputs on one tp rank (and the head's)."""
    heads = model_cfg.num_heads
    if isinstance(model_cfg, DeepSeekConfig):
        whole = [model_cfg.kv_lora_rank, model_cfg.kv_lora_rank + model_cfg.qk_rope_head_dim]
        whole += [model_cfg.q_lora_rank] if model_cfg.q_lora_rank else []
        split = [heads * model_cfg.qk_head_dim, heads * (model_cfg.qk_nope_head_dim + model_cfg.v_head_dim),
                 heads * model_cfg.v_head_dim, model_cfg.expert_ffn_dim, model_cfg.dense_ffn_dim or tp]
    else:
        ffn = model_cfg.expert_ffn_dim if isinstance(model_cfg, MoEConfig) else model_cfg.ffn_dim
        whole, split = [], [heads * model_cfg.head_dim, model_cfg.num_kv_heads * model_cfg.head_dim, ffn]
    split += [model_cfg.vocab_size] if head else []
    return [model_cfg.dim, *whole] + [dim // tp for dim in split]


def with_global_batch(config: Config, world_size: int) -> Config:
    """`--global-batch` unset means one micro-batch per data-parallel rank, and with pp > 1,
    2 x pp of them: enough for every schedule (a multiple of pp) and a bubble of at most a third
    with 1F1B, (pp - 1) / (3 pp - 1), where pp would leave it near a half. 1F1B holds at most pp
    micro-batches on a stage whatever the number per step; GPipe and looped BFS hold all of them."""
    d, p = config.data, config.parallel
    if d.global_batch is not None:
        return config
    mesh_spec = MeshSpec.parse(p.mesh, world_size)
    per_rank = 1 if mesh_spec.pp == 1 else DEFAULT_MICROBATCHES_PER_STAGE * mesh_spec.pp
    config = attrs.evolve(config, data=attrs.evolve(d, global_batch=d.micro_batch * mesh_spec.dp_size * per_rank))
    if mesh_spec.pp > 1:
        bubble = pipeline.ideal_bubble(mesh_spec.pp, p.pp_virtual_stages, per_rank)
        logger.info("pipeline: no --global-batch given: %d micro-batches of %d per step on each data-parallel rank "
                    "(2 x pp=%d; ideal %s bubble %.0f%%), global batch %d; set --global-batch to choose",
                    per_rank, d.micro_batch, mesh_spec.pp, p.pp_schedule, 100 * bubble, config.data.global_batch)
    return config


def build_plan(config: Config, mesh_spec: MeshSpec, model_cfg: LlamaConfig) -> Plan:
    return Plan.build(mesh_spec, sequence_parallel=config.parallel.sequence_parallel,
                      num_kv_heads=model_cfg.num_kv_heads,
                      tp_overlap=rank_model.tp_overlap_method(config, mesh_spec) is not None)
