"""The training run: validate every input, lay the model out on the mesh, and step."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from dtrain import data as data_lib
from dtrain import distributed
from dtrain.config import Config, to_toml
from dtrain.metrics import MetricsLogger, peak_flops, peak_memory_gb
from dtrain.optim import build_optimizer, build_scheduler
from models import flops, llama
from models.config import LlamaConfig, get_model_config
from models.errors import UserError
from parallel.gradients import clip_grads_
from parallel.mesh import MeshSpec, build_device_mesh
from parallel.parallelize import parallelize
from parallel.plan import Plan

logger = logging.getLogger("dtrain")

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def validate(config: Config, world_size: int) -> tuple[MeshSpec, LlamaConfig]:
    """Every check that needs no memory, so a bad input fails before any work is done."""
    model_cfg = get_model_config(config.model.model, config.model.model_overrides)
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    tp, heads, kv_heads = mesh_spec.tp, model_cfg.num_heads, model_cfg.num_kv_heads
    if heads % tp:
        raise UserError(
            f"model {config.model.model} has num_heads={heads}, not divisible by tp={tp}; choose a tp that divides {heads}"
        )
    if kv_heads % tp and tp % kv_heads:
        raise UserError(
            f"model {config.model.model} has num_kv_heads={kv_heads} and tp={tp}: one must divide the "
            f"other (KV heads are split, or replicated over groups of tp ranks); change tp"
        )
    if mesh_spec.ep > 1:
        raise UserError(f"ep={mesh_spec.ep} needs a mixture-of-experts model; {config.model.model} is dense")
    for name in ("pp", "cp"):
        if getattr(mesh_spec, name) > 1:
            raise UserError(f"{name}={getattr(mesh_spec, name)} is not available yet; use dp, dp_replicate and tp")
    d, t = config.data, config.train
    for name, value in (("--seq-len", d.seq_len), ("--micro-batch", d.micro_batch),
                        ("--global-batch", d.global_batch), ("--steps", t.steps)):
        if value < 1:
            raise UserError(f"{name} {value} must be >= 1")
    per_step = d.micro_batch * mesh_spec.dp_size
    if d.global_batch % per_step:
        raise UserError(
            f"--global-batch {d.global_batch} is not divisible by --micro-batch {d.micro_batch} x "
            f"data-parallel size {mesh_spec.dp_size} = {per_step}; make it a multiple of {per_step}"
        )
    if config.parallel.async_tp and not (config.train.compile and config.parallel.sequence_parallel
                                         and tp > 1 and torch.cuda.is_available()):
        raise UserError("--async-tp needs --compile, --sequence-parallel, a mesh with tp > 1 and CUDA GPUs")
    if config.optim.warmup_steps < 0 or config.optim.lr <= 0:
        raise UserError("--lr must be > 0 and --warmup-steps >= 0")
    data_lib.validate_data_args(d.data, d.tokenizer)
    return mesh_spec, model_cfg


def print_plan(config: Config) -> None:
    """The plan for the mesh as given; without torchrun the world is what the mesh names."""
    world_size = distributed.world_size_from_env() if distributed.launched_by_torchrun() else None
    mesh_spec = MeshSpec.parse(config.parallel.mesh, world_size)
    _, model_cfg = validate(config, mesh_spec.world_size)
    plan = _plan(config, mesh_spec, model_cfg)
    print(plan.describe(llama.layers(model_cfg)))


def _plan(config: Config, mesh_spec: MeshSpec, model_cfg: LlamaConfig) -> Plan:
    return Plan.build(mesh_spec, sequence_parallel=config.parallel.sequence_parallel,
                      num_kv_heads=model_cfg.num_kv_heads)


def train(config: Config) -> list[dict[str, float]]:
    """Runs the configured training; returns every step's scalars (the loss on every rank)."""
    validate(config, distributed.world_size_from_env())
    runtime = distributed.init_process_group()
    try:
        return _train(config, runtime)
    finally:
        distributed.shutdown()


def _train(config: Config, runtime: distributed.Runtime) -> list[dict[str, float]]:
    mesh_spec, model_cfg = validate(config, runtime.world_size)
    d, t = config.data, config.train
    run_dir = Path(t.run_dir)
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(config))
    # The data is read (and its token ids checked against the model) before any model memory.
    dataset = data_lib.TokenDataset(d.data, d.tokenizer, d.seq_len, model_cfg.vocab_size, t.seed)
    mesh = build_device_mesh(mesh_spec, runtime.device.type)
    plan = _plan(config, mesh_spec, model_cfg)
    layers = llama.layers(model_cfg)
    model, ctx = parallelize(
        layers, plan, mesh, device=runtime.device, seed=t.seed,
        compute_dtype=COMPUTE_DTYPES[t.precision], recompute_mode=t.recompute, compile_blocks=t.compile,
        async_tp=config.parallel.async_tp,
    )
    optimizer = build_optimizer(model, model.specs, config.optim)
    scheduler = build_scheduler(optimizer, t.steps, config.optim)

    dp_rank = mesh.get_local_rank("dp_replicate") * mesh_spec.dp_shard + mesh.get_local_rank("dp_shard")
    dp_groups = [mesh.get_group(dim) for dim in ("dp_shard", "dp_replicate") if mesh.size(mesh.mesh_dim_names.index(dim)) > 1]
    global_tokens = d.global_batch * d.seq_len
    # Each rank's summed loss is scaled so that FSDP's average over the dp ranks yields the
    # gradient of the mean loss over the whole global batch.
    loss_scale = mesh_spec.dp_size / global_tokens
    rope_aux = llama.make_aux(model_cfg, torch.arange(d.seq_len, device=runtime.device))
    peak = peak_flops(runtime.device)
    flops_per_token = flops.flops_per_token(model_cfg, d.seq_len)
    metrics = MetricsLogger(run_dir, runtime.is_main, peak, runtime.device)
    if runtime.is_main:
        logger.info("model %s: %.2fM parameters | mesh %s | world %d | %s", config.model.model,
                    sum(math.prod(s.shape) for s in model.specs.values()) / 1e6, mesh_spec,
                    runtime.world_size, runtime.device.type)

    history = []
    for step in range(t.steps):
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=runtime.device)
        micro_batches = dataset.micro_batches(step, d.global_batch, d.micro_batch, dp_rank, mesh_spec.dp_size)
        with ctx.kernel_scope():
            for inputs, labels in micro_batches:
                aux = attrs.evolve(rope_aux, labels=labels.to(runtime.device, non_blocking=True))
                micro_loss = model(inputs.to(runtime.device, non_blocking=True), aux)
                (micro_loss * loss_scale).backward()
                loss_sum += micro_loss.detach().float()
        grad_norm = clip_grads_(model.parameters(), config.optim.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for group in dp_groups:
            dist.all_reduce(loss_sum, group=group)
        loss = loss_sum.item() / global_tokens
        elapsed = time.perf_counter() - start
        if not math.isfinite(loss):
            raise UserError(f"the loss is {loss} at step {step + 1}; lower --lr or check the data")
        tokens_per_sec_per_gpu = global_tokens / elapsed / runtime.world_size
        scalars = {
            "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm.item(),
            "perf/tokens_per_sec_per_gpu": tokens_per_sec_per_gpu,
            "mem/peak_gb": peak_memory_gb(runtime.device),
        }
        if peak is not None:
            scalars["perf/mfu"] = 100.0 * flops_per_token * tokens_per_sec_per_gpu / peak
        history.append(scalars)
        metrics.log(step + 1, t.steps, scalars, console=(step + 1) % t.log_every == 0 or step + 1 == t.steps)
    metrics.close()
    return history
