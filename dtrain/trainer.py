"""The training loop: one object that owns the model, optimizer, data and metrics of a run."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from dtrain import data as data_lib
from dtrain.checkpointer import Checkpointer
from dtrain.config import Config, to_toml
from dtrain.distributed import Runtime
from dtrain.metrics import MetricsLogger, peak_flops, peak_memory_gb
from dtrain.optim import build_optimizer, build_scheduler
from dtrain.train import build_plan, validate
from models import flops, llama
from models.errors import UserError
from parallel.gradients import clip_grads_
from parallel.mesh import build_device_mesh
from parallel.parallelize import parallelize

logger = logging.getLogger("dtrain")

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Trainer:
    """Builds everything a run needs (data first, so bad data fails before model memory), then
    steps. `step` counts completed optimizer steps; the data of step s is a pure function of
    (seed, s), so the step is also the data position."""

    def __init__(self, config: Config, runtime: Runtime):
        self.config, self.runtime = config, runtime
        self.mesh_spec, self.model_cfg = validate(config, runtime.world_size)
        d, t = config.data, config.train
        self.run_dir = Path(t.run_dir)
        if runtime.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(config))
        self.dataset = data_lib.TokenDataset(d.data, d.tokenizer, d.seq_len, self.model_cfg.vocab_size, t.seed)
        self.mesh = build_device_mesh(self.mesh_spec, runtime.device.type)
        self.plan = build_plan(config, self.mesh_spec, self.model_cfg)
        self.model, self.ctx = parallelize(
            llama.layers(self.model_cfg), self.plan, self.mesh, device=runtime.device, seed=t.seed,
            compute_dtype=COMPUTE_DTYPES[t.precision], recompute_mode=t.recompute,
            compile_blocks=t.compile, async_tp=config.parallel.async_tp,
        )
        self.optimizer = build_optimizer(self.model, self.model.specs, config.optim)
        self.scheduler = build_scheduler(self.optimizer, t.steps, config.optim)
        self.checkpointer = Checkpointer(self)
        # --resume's checkpoint (any mesh), else --init-from-hf's weights; the step to start at.
        self.step = self.checkpointer.restore()

        self.dp_rank = (self.mesh.get_local_rank("dp_replicate") * self.mesh_spec.dp_shard
                        + self.mesh.get_local_rank("dp_shard"))
        self.loss_groups = [self.mesh.get_group(dim) for dim in ("dp_shard", "dp_replicate")
                            if getattr(self.mesh_spec, dim) > 1]
        self.global_tokens = d.global_batch * d.seq_len
        # Each rank's summed loss is scaled so that FSDP's average over the dp ranks yields the
        # gradient of the mean loss over the whole global batch.
        self.loss_scale = self.mesh_spec.dp_size / self.global_tokens
        self.rope_aux = llama.make_aux(self.model_cfg, torch.arange(d.seq_len, device=runtime.device))
        self.peak_flops = peak_flops(runtime.device)
        self.flops_per_token = flops.flops_per_token(self.model_cfg, d.seq_len)
        self.metrics = MetricsLogger(self.run_dir, runtime.is_main, self.peak_flops, runtime.device)
        if runtime.is_main:
            logger.info("model %s: %.2fM parameters | mesh %s | world %d | %s", config.model.model,
                        sum(math.prod(s.shape) for s in self.model.specs.values()) / 1e6, self.mesh_spec,
                        runtime.world_size, runtime.device.type)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulates the gradients of this rank's micro-batches; returns their summed loss."""
        device = self.runtime.device
        loss_sum = torch.zeros((), device=device)
        with self.ctx.kernel_scope():
            for inputs, labels in micro_batches:
                aux = attrs.evolve(self.rope_aux, labels=labels.to(device, non_blocking=True))
                micro_loss = self.model(inputs.to(device, non_blocking=True), aux)
                (micro_loss * self.loss_scale).backward()
                loss_sum += micro_loss.detach().float()
        return loss_sum

    def train_step(self) -> dict[str, float]:
        d = self.config.data
        start = time.perf_counter()
        micro_batches = self.dataset.micro_batches(
            self.step, d.global_batch, d.micro_batch, self.dp_rank, self.mesh_spec.dp_size
        )
        loss_sum = self.forward_backward(micro_batches)
        grad_norm = clip_grads_(self.model.parameters(), self.config.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.loss_groups:
            dist.all_reduce(loss_sum, group=group)
        loss = loss_sum.item() / self.global_tokens
        elapsed = time.perf_counter() - start
        self.step += 1
        if not math.isfinite(loss):
            raise UserError(f"the loss is {loss} at step {self.step}; lower --lr or check the data")
        tokens_per_sec_per_gpu = self.global_tokens / elapsed / self.runtime.world_size
        scalars = {
            "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm.item(),
            "perf/tokens_per_sec_per_gpu": tokens_per_sec_per_gpu,
            "mem/peak_gb": peak_memory_gb(self.runtime.device),
        }
        if self.peak_flops is not None:
            scalars["perf/mfu"] = 100.0 * self.flops_per_token * tokens_per_sec_per_gpu / self.peak_flops
        return scalars

    def fit(self, before_step=None) -> list[dict[str, float]]:
        """Steps until `--steps`; returns every step's scalars. `before_step(step)` is called
        before each step (benchmarks use it to start and stop the profiler)."""
        total, history = self.config.train.steps, []
        self.checkpointer.start()
        try:
            while self.step < total:
                if before_step is not None:
                    before_step(self.step)
                scalars = self.train_step()
                history.append(scalars)
                console = self.step % self.config.train.log_every == 0 or self.step == total
                self.metrics.log(self.step, total, scalars, console=console)
                if self.checkpointer.after_step(self.step):
                    break  # preempted: saved, and every rank stops here
            self.checkpointer.finish(self.step)
        finally:
            self.checkpointer.close()
            self.metrics.close()
        return history
