"""Every check of a run's options, made by `resolve` (dtrain/layout/resolve.py) once, before any
work is done: a bad input fails in one line that says what to change.

    check_options   what needs neither the model nor the mesh: sizes, the optimizer, modes
    check_split     the model over the mesh: heads over tp, experts over ep, blocks over stages, the
                    sequence over cp
    check_kernels   async TP and the tp overlap, FP8
    check_choices   what the micro-batch, recompute, data-parallel mode and CPU offload choose (the
                    planner's variants of one mesh are checked here alone)
    check_inputs    the data and the checkpoint paths
    check_dry_run   what --dry-run cannot run yet
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from dtrain.config import GROUPS, Config
from dtrain.data import validate_data_args
from dtrain.layout.machine import Machine
from models.config import DeepSeekConfig, MoEConfig
from models.errors import UserError
from models.linear_cross_entropy import check_chunk_tokens
from parallel import fp8_experts, pipeline, precision, recompute, te_linear
from parallel.mesh import MeshSpec

MAX_TIMEOUT_S = 7 * 24 * 3600.0
# The values of --resume that name --run-dir's own checkpoints rather than a path.
RUN_DIRS_OWN = ("latest", "auto")


def check_options(config: Config, world_size: int) -> None:
    """What needs neither the model nor the mesh."""
    _check_choices_of_fields(config)
    p = config.parallel
    planning = p.print_plan or p.dry_run
    if p.world_size is not None and not planning and p.world_size != world_size:
        raise UserError(f"--world-size {p.world_size} is for --dry-run and --print-plan; this run has {world_size} "
                        f"process(es): drop --world-size or start {p.world_size}")
    if p.dry_run_rank is not None and not p.dry_run:
        raise UserError("--dry-run-rank needs --dry-run")
    if p.dry_run_rank is not None and not 0 <= p.dry_run_rank < world_size:
        raise UserError(f"--dry-run-rank {p.dry_run_rank} is not a rank of a world of {world_size}; "
                        f"use 0..{world_size - 1}")
    if p.json and not p.print_plan:
        raise UserError("--json prints the layout of --print-plan; give --print-plan with it")
    _check_sizes(config)
    _check_optimizer(config.optim)
    t = config.train
    if t.start_over and t.resume is None:
        raise UserError("--start-over needs --resume: a run without --resume starts at step 0 anyway")
    if t.start_over and t.resume not in RUN_DIRS_OWN:
        raise UserError(f"--start-over applies to --resume latest or auto (the checkpoints of --run-dir); "
                        f"--resume {t.resume} loads that checkpoint or stops: drop one of them")


def _check_choices_of_fields(config: Config) -> None:
    """A value from a TOML file is one of the flag's choices (the command line checks its own)."""
    for group_name, group_cls in GROUPS.items():
        group = getattr(config, group_name)
        for field in attrs.fields(group_cls):
            choices, value = field.metadata.get("choices"), getattr(group, field.name)
            if choices and value is not None and value not in choices:
                raise UserError(f"--{field.name.replace('_', '-')} {value!r}: choose one of {', '.join(choices)}")


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
    if t.overwrite and t.resume is not None:
        raise UserError(f"--overwrite deletes the run that --resume {t.resume} would continue; leave out one of them")
    if config.optim.warmup_steps < 0:
        raise UserError(f"--warmup-steps {config.optim.warmup_steps} must be >= 0")


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


def check_split(config: Config, model_cfg, mesh: MeshSpec, machine: Machine) -> None:
    """Heads over tp, experts over ep, blocks over pipeline stages, the sequence over cp."""
    name, d, p = config.model.model, config.data, config.parallel
    tp, heads, kv_heads = mesh.tp, model_cfg.num_heads, model_cfg.num_kv_heads
    if heads % tp:
        raise UserError(f"model {name} has num_heads={heads}, not divisible by tp={tp}; choose a tp that divides {heads}")
    if kv_heads % tp and tp % kv_heads:
        raise UserError(f"model {name} has num_kv_heads={kv_heads} and tp={tp}: one must divide the other (KV heads "
                        f"are split, or replicated over groups of tp ranks); change tp")
    is_moe = isinstance(model_cfg, MoEConfig)
    if mesh.ep > 1 and not is_moe:
        raise UserError(f"ep={mesh.ep} needs a mixture-of-experts model; {name} is dense")
    if mesh.ep > 1 and model_cfg.num_experts % mesh.ep:
        raise UserError(f"model {name} has {model_cfg.num_experts} experts, not divisible by ep={mesh.ep}; "
                        f"choose an ep that divides {model_cfg.num_experts}")
    if mesh.ep > 1 and p.ep_dispatch == "allgather" and model_cfg.capacity_factor is not None:
        raise UserError(f"--ep-dispatch allgather sends every token to its experts and drops none; remove "
                        f"capacity_factor={model_cfg.capacity_factor} or use --ep-dispatch alltoall")
    if mesh.ep > 1 and p.ep_dispatch == "allgather" and model_cfg.scale_expert_inputs and model_cfg.top_k > 1:
        raise UserError(f"--ep-dispatch allgather sends each token once, but with scale_expert_inputs each of its "
                        f"top_k={model_cfg.top_k} experts sees it scaled by its own weight; use --ep-dispatch alltoall")
    if is_moe and tp > 1 and d.seq_len % tp:
        raise UserError(f"--seq-len {d.seq_len} is not divisible by tp={tp}: MoE layers split the tokens over tp; "
                        f"use a multiple of {tp}")
    if mesh.pp > 1:
        if model_cfg.tie_embeddings:
            raise UserError(f"model {name} ties its embedding and head, which pp={mesh.pp} puts on different "
                            f"ranks; use --model-overrides tie_embeddings=false or pp=1")
        pipeline.validate_schedule(p.pp_schedule, mesh.pp, p.pp_virtual_stages, model_cfg.num_layers, p.pp_layout,
                                   on_gpus=machine.device_type == "cuda")
    _check_sequence_split(config, model_cfg, mesh)


def _check_sequence_split(config: Config, model_cfg, mesh: MeshSpec) -> None:
    """Context parallelism's chunks."""
    d, cp, tp = config.data, mesh.cp, mesh.tp
    if cp == 1:
        return
    if d.seq_len % (2 * cp):
        raise UserError(f"--seq-len {d.seq_len} is not divisible by 2 x cp = {2 * cp} (load-balanced context "
                        f"parallelism cuts each sequence into 2 x cp chunks); use a multiple of {2 * cp}")
    local_heads, local_kv = model_cfg.num_heads // tp, max(model_cfg.num_kv_heads // tp, 1)
    if config.parallel.cp_comm == "a2a" and (local_heads % cp or local_kv % cp):
        raise UserError(f"--cp-comm a2a splits heads over cp={cp}, but each tp rank has {local_heads} query "
                        f"and {local_kv} KV heads; use --cp-comm allgather or ring, or a cp dividing both")


def check_kernels(config: Config, model_cfg, mesh: MeshSpec, machine: Machine, tp_overlap: str | None) -> None:
    """Async TP and the tp overlap (`tp_overlap`: what --tp-overlap resolved to), FP8."""
    t, p, tp = config.train, config.parallel, mesh.tp
    if p.async_tp and not (t.compile and p.sequence_parallel and tp > 1 and machine.device_type == "cuda"):
        raise UserError("--async-tp needs --compile, --sequence-parallel, a mesh with tp > 1 and CUDA GPUs")
    if tp_overlap is not None and (config.data.seq_len // mesh.cp) % tp:
        raise UserError(f"--tp-overlap splits each rank's {config.data.seq_len // mesh.cp} tokens of a sequence "
                        f"into tp={tp} equal shards; use a --seq-len divisible by {tp * mesh.cp}, or "
                        f"--tp-overlap none")
    if t.fp8_head and t.fp8 is None:
        raise UserError("--fp8-head runs the output projection in FP8; give --fp8 RECIPE with it")
    check_chunk_tokens(t.loss_chunk_tokens)
    if t.loss_chunk_tokens and t.fp8_head:
        raise UserError("--loss-chunk-tokens runs the output projection in bf16, a chunk at a time; --fp8-head runs "
                        "it in FP8 on all tokens at once: drop one of them")
    _check_fp8_experts(t, model_cfg)
    if t.fp8 is not None:
        if t.precision != "bf16":
            raise UserError(f"--fp8 runs the other ops in bf16; use --precision bf16, not {t.precision}")
        if t.fp8_amax_history < 1:
            raise UserError(f"--fp8-amax-history {t.fp8_amax_history} must be >= 1")
        precision.validate_fp8(t.fp8, t.fp8_backend, _matmul_widths(model_cfg, tp, t.fp8_head),
                               check_here=machine.local)


def _check_fp8_experts(t, model_cfg) -> None:
    """`--fp8-experts` has routed experts to run in FP8 and an FP8 kernel that takes them:
    torchao's FP8 grouped GEMMs (with or without --fp8 for the other matmuls), or Transformer
    Engine's under --fp8-backend te."""
    if not t.fp8_experts:
        return
    if not isinstance(model_cfg, MoEConfig):
        raise UserError("--fp8-experts: this model has no routed experts; drop the flag")
    if t.fp8_backend == "te":
        if t.fp8 is None:
            raise UserError("--fp8-experts with --fp8-backend te runs the routed experts in Transformer Engine's FP8 "
                            "grouped GEMM; give --fp8 RECIPE with it (or use --fp8-backend torchao)")
        if model_cfg.expert_bias or model_cfg.expert_glu is not None:
            raise UserError("--fp8-experts: Transformer Engine's FP8 experts run plain SwiGLU without biases, and "
                            "this model's experts have biases or gpt-oss's clamped unit; use --fp8-backend torchao "
                            "for FP8 experts, or drop the flag (they run in bf16)")
    fp8_experts.check_shapes(model_cfg.dim, model_cfg.expert_ffn_dim)


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


def check_choices(config: Config, model_cfg, mesh: MeshSpec, blocks_per_stage: tuple[int, ...]) -> None:
    """What the micro-batch, recompute, data-parallel mode and CPU offload choose (the
    data-parallel mode's own rules: `data_parallel.fsdp_settings`)."""
    d, p, t = config.data, config.parallel, config.train
    per_step = d.micro_batch * mesh.dp_size
    if d.global_batch % per_step:
        raise UserError(f"--global-batch {d.global_batch} is not divisible by --micro-batch {d.micro_batch} x "
                        f"data-parallel size {mesh.dp_size} = {per_step}; make it a multiple of {per_step}")
    if mesh.pp > 1:
        pipeline.validate_microbatches(p.pp_schedule, mesh.pp, d.global_batch // per_step)
    if p.dp_mode == "zero1" and p.cpu_offload:
        raise UserError("--dp-mode zero1 keeps the parameters whole on the GPU through the step, --cpu-offload keeps "
                        "them in host memory: drop one of them")
    if p.cpu_offload and t.fp8 == "tensorwise" and t.fp8_all_gather:
        raise UserError("--cpu-offload keeps the weights' shards in host memory, where the float8 all-gather's "
                        "scales cannot be computed; add --no-fp8-all-gather (the FP8 matmuls stay)")
    if t.fp8 in te_linear.TE_RECIPES and t.fp8_backend == "te":
        # The rows of one matmul: a rank's micro-batch (its cp chunks); MoE layers split them over tp.
        is_moe = isinstance(model_cfg, MoEConfig)
        te_linear.check_tokens(t.fp8, d.micro_batch * d.seq_len // (mesh.cp * (mesh.tp if is_moe else 1)))
    recompute.validate_partial(t.recompute_layers, t.recompute, list(blocks_per_stage))


def check_inputs(config: Config) -> None:
    """The data, and the checkpoints a run starts from, exist and are what they claim."""
    d, t = config.data, config.train
    validate_data_args(d.data, d.tokenizer, d.split, d.synthetic_document_length)
    for name, path in (("--resume", t.resume if t.resume not in RUN_DIRS_OWN else None),
                       ("--init-from-hf", t.init_from_hf)):
        if path is not None and not Path(path).exists():
            raise UserError(f"{name} {path}: no such checkpoint directory")


def check_dry_run(config: Config) -> None:
    """What --dry-run cannot run on fake tensors yet."""
    if config.train.fp8 is not None and config.train.fp8_backend == "te":
        raise UserError("--dry-run does not run Transformer Engine's FP8 kernels (CUDA only); use "
                        "--fp8-backend torchao for the dry run, whose FP8 casts run on fake tensors")
