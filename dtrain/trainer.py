"""The training loop: one object that owns the model, optimizer, data and metrics of a run."""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from dtrain import distributed
from dtrain.checkpoint.checkpointer import Checkpointer
from dtrain.config import to_toml
from dtrain.data import TokenDataset
from dtrain.diagnose import journal
from dtrain.distributed import Runtime
from dtrain.layout import RunLayout
from dtrain.metrics import MetricsLogger, mtp_scalars, peak_flops, peak_memory_gb, router_scalars, timing_event
from dtrain.optim import build_optimizer, build_scheduler
from dtrain.layout.host_memory import check_host_memory
from dtrain.rank_inputs import RankInputs
from dtrain.rank_model import build_training_model
from dtrain.run_summary import closing_lines
from dtrain.resilience.faults import FaultInjector
from dtrain.resilience.heartbeat import Heartbeat
from dtrain.resilience.step_guard import Decision, StepGuard
from dtrain.resilience.stop_request import StopRequest
from dtrain.resilience.stragglers import Stragglers
from dtrain.resilience.watchdog import Watchdog
from dtrain.step_stats import StepStats, ep_line
from models import flops, moe, mtp, spec
from parallel import precision
from parallel.data_parallel import expert_parameters, rescale_expert_grads_, set_micro_batch_sync
from parallel.gradients import clip_grads_
from parallel.mesh import build_meshes

logger = logging.getLogger("dtrain")
# Profiler ranges (no-ops unless a profiler runs) that `python -m tools.bench --profile` counts as
# the optimizer's: the gradient clip, and the update with what FP8 refreshes after it.
CLIP_RANGE, OPTIMIZER_RANGE = "dtrain::clip_grads", "dtrain::optimizer_step"


class Trainer:
    """Builds everything a run needs (data first, so bad data fails before model memory), then
    steps. `step` counts optimizer steps, skipped ones included; `consumed_samples` is the data
    position (step x global batch, unless a resumed run changed --global-batch). `heartbeat` is
    told where the run is; `watchdog` (hang detection) is told when steps and saves begin and end."""

    def __init__(self, layout: RunLayout, runtime: Runtime, heartbeat: Heartbeat | None = None,
                 watchdog: Watchdog | None = None):
        config = layout.config
        self.layout, self.config, self.runtime = layout, config, runtime
        self.beat, self.watchdog = heartbeat or Heartbeat(runtime.rank), watchdog
        self.mesh_spec, self.model_cfg, self.plan = layout.mesh, layout.model_cfg, layout.plan
        check_host_memory(layout, runtime.rank, runtime.device.type)  # before any allocation
        d, t = config.data, config.train
        self.run_dir = Path(t.run_dir)
        if runtime.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(config))
        self.dataset = TokenDataset.from_args(d, self.model_cfg.vocab_size, t.seed)
        self.val_dataset = (TokenDataset.from_args(d, self.model_cfg.vocab_size, t.seed, part="validation")
                            if t.eval_every > 0 else None)
        if runtime.is_main:
            logger.info("data: %s", self.dataset.describe())
        self.meshes = build_meshes(self.mesh_spec, runtime.device.type)
        self.global_tokens, self.loss_scale = layout.global_tokens, layout.loss_scale
        built = build_training_model(layout, self.meshes, device=runtime.device, is_main=runtime.is_main)
        self.model_parts, self.ctx, self.pipeline, self.tied_copies = built.parts, built.ctx, built.runner, \
            built.tied_copies
        # Transformer Engine's delayed scaling: amax histories and scales, updated after each step.
        self.fp8_scaling = getattr(built.fp8, "scaling", None)
        # The whole model on this rank; with pipelining, this rank's stages (several for
        # interleaved schedules) are `model_parts`.
        self.model = self.model_parts[0] if len(self.model_parts) == 1 else None
        self.expert_params = expert_parameters(self.model_parts, self.plan)
        # Weights FSDP gathers in float8 get their scales from the updated values after each step.
        self.refresh_float8_scales = bool(precision.float8_gathered_params(self.model_parts))
        # Under CPU offload the parameters are in host memory: the fused kernel steps them there
        # in one pass, and takes the clip scale as it reads the gradients.
        self.optimizer = build_optimizer(self.model_parts, config.optim)
        self.scheduler = build_scheduler(self.optimizer, t.steps, config.optim)
        self.guard = StepGuard(max_skipped_steps=t.max_skipped_steps, spike_factor=t.skip_spikes,
                               spike_window=t.spike_window, global_tokens=self.global_tokens,
                               device=runtime.device, is_main=runtime.is_main)
        self.checkpointer = Checkpointer(layout, runtime, model_parts=self.model_parts, optimizer=self.optimizer,
                                         scheduler=self.scheduler, fp8_scaling=self.fp8_scaling,
                                         run_state=self._run_state)
        # --resume's checkpoint (any mesh), else --init-from-hf's weights; the step to start at.
        resumed = self.checkpointer.restore()
        self.step, self.consumed_samples = resumed.step, resumed.consumed_samples
        self.guard.load_state_dict(resumed.meta.get("skips"))
        self.beat.heading_for(self.step + 1)
        if watchdog is not None:
            watchdog.terminating = lambda: self.checkpointer.stop_signal == signal.SIGTERM
            # A background save's group keeps its long timeout: its collectives wait for the writes.
            groups = [g for g in distributed.process_groups() if g is not self.checkpointer.async_group]
            watchdog.adopt_groups(groups, distributed.set_collective_timeout)
            watchdog.starting_at(self.step)

        meshes = self.meshes
        self.dp_rank = meshes.local_rank("dp_replicate") * self.mesh_spec.dp_shard + meshes.local_rank("dp_shard")
        # The loss is summed over the data-parallel ranks, and taken from the last pipeline stage.
        self.loss_groups = meshes.groups(self.mesh_spec.loss_dims)
        self.pp_group = meshes.group("pp") if self.mesh_spec.pp > 1 else None
        self.expert_grad_groups = meshes.groups(self.mesh_spec.expert_grad_sum_dims)
        self.inputs = RankInputs(layout, meshes.local_rank("cp"), self.ctx, runtime.device)
        self.stats = StepStats(self.model_cfg, self.inputs.base, self.model_parts,
                               meshes.groups(self.mesh_spec.router_stats_dims), self.loss_groups, runtime.device)
        self.peak_flops = peak_flops(runtime.device)
        self._last_read_back = 0.0
        # On the CPU the launch does the work, so there is nothing to overlap: read back at once.
        self.overlap_read_back = runtime.device.type != "cpu"
        self.flops_per_token = flops.flops_per_token(self.model_cfg, d.seq_len)
        self.metrics = MetricsLogger(self.run_dir, runtime.is_main, self.peak_flops, runtime.device,
                                     start_step=self.step)
        if runtime.is_main:
            self.metrics.event("start", self.step, **journal.start_fields(layout, runtime.device))
        self.faults = FaultInjector(runtime.rank, self.run_dir)
        self.stragglers = Stragglers(self.model_parts, t.straggler_every, runtime.device,
                                     stage=meshes.local_rank("pp"), is_main=runtime.is_main)
        self.stop_request = StopRequest(self.run_dir, runtime.is_main)
        if runtime.is_main:
            logger.info("model %s: %.2fM parameters | mesh %s | world %d | %s%s", config.model.model,
                        spec.count_params(layout.layers) / 1e6, self.mesh_spec, runtime.world_size,
                        runtime.device.type, ep_line(self.model_cfg, self.mesh_spec.ep, layout.parallel.ep_dispatch))

    def parameters(self):
        return [param for part in self.model_parts for param in part.parameters()]

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         loss_factor: float = 1.0) -> torch.Tensor:
        """Accumulates the gradients of this rank's micro-batches; returns their summed loss.
        `loss_factor` multiplies the loss before backward (fault injection: NaN or a spike)."""
        device = self.runtime.device
        # Every micro-batch's labels, positions and attention mask first, on the host while the
        # device still runs the previous step, rather than between the forwards.
        auxes = [self.inputs.aux(batch) for batch in micro_batches]
        if self.pipeline is not None:
            inputs = self.inputs.tokens(torch.cat([inputs for inputs, _ in micro_batches]))
            targets = self.inputs.pipeline_targets(torch.cat([labels for _, labels in micro_batches]))
            self.beat.phase("forward")  # the schedule's forwards and backwards
            with self.ctx.kernel_scope():
                return self.pipeline.step(inputs, targets, auxes, loss_factor)
        loss_sum = torch.zeros((), device=device)
        with self.ctx.kernel_scope():
            for index, (batch, aux) in enumerate(zip(micro_batches, auxes)):
                set_micro_batch_sync(self.model, last=index == len(micro_batches) - 1)
                self.beat.phase("forward")
                micro_loss = self.model(self.inputs.tokens(batch[0]), aux)
                if loss_factor != 1.0:
                    micro_loss = micro_loss * loss_factor
                self.beat.phase("backward")
                (micro_loss * self.loss_scale).backward()
                loss_sum += micro_loss.detach().float()
        return loss_sum

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over one pass of the validation split (the same samples every time)."""
        d, t = self.config.data, self.config.train
        device = self.runtime.device
        self.beat.phase("eval")
        num_steps = self.val_dataset.eval_steps(t.eval_steps, d.global_batch)
        batches = list(self.val_dataset.eval_micro_batches(
            t.eval_steps, d.global_batch, d.micro_batch, self.dp_rank, self.mesh_spec.dp_size))
        loss_sum = torch.zeros((), device=device)
        with self.ctx.kernel_scope():
            if self.pipeline is not None:
                per_step = len(batches) // num_steps
                for first in range(0, len(batches), per_step):
                    group = batches[first:first + per_step]
                    loss_sum += self.pipeline.evaluate(self.inputs.tokens(torch.cat([b[0] for b in group])),
                                                       self.inputs.pipeline_targets(torch.cat([b[1] for b in group])),
                                                       [self.inputs.aux(b) for b in group])
            else:
                for batch in batches:
                    loss_sum += self.model(self.inputs.tokens(batch[0]), self.inputs.aux(batch)).float()
        for group in self.loss_groups:
            dist.all_reduce(loss_sum, group=group)
        for stats in (self.stats.router_stats, self.stats.mtp_stats):
            if stats is not None:
                stats.reset()  # evaluation is not training statistics
        return loss_sum.item() / (num_steps * d.global_batch * d.seq_len)

    def _run_state(self) -> dict:
        """What a checkpoint keeps of the run beside the model: the data position and the skips."""
        return {"consumed_samples": self.consumed_samples, "global_batch": self.config.data.global_batch,
                "skips": self.guard.state_dict()}

    def launch_step(self) -> "LaunchedStep":
        """Queues one whole step (forward, backward, clipping, update) on the device and returns
        without waiting for it: its loss and norms are read back later (`_read_back`), while the
        device already runs the next step.

        A non-finite loss or gradient norm (or a spike, with --skip-spikes) skips the update on
        the device: the fused AdamW takes the decision as `found_inf` and leaves the weights, its
        moments and its step count as they were. The LR schedule and the data position advance."""
        d = self.config.data
        launched_at = time.perf_counter()
        self.beat.begin_step(self.step + 1)
        self.faults.at_step_start(self.step + 1)
        micro_batches = self.dataset.micro_batches(
            self.step, d.global_batch, d.micro_batch, self.dp_rank, self.mesh_spec.dp_size,
            first_sample=self.consumed_samples,
        )
        data_s = time.perf_counter() - launched_at
        # The device's time for the step runs from here (once the previous step's kernels are done)
        # to `done`; for the rest of the time between read-backs it waited for the host.
        device_from = timing_event(self.runtime.device)
        attended_pairs = self.inputs.attended_pairs(micro_batches)
        self.stragglers.arm(self.step + 1)
        loss_sum = self.forward_backward(micro_batches, self.faults.loss_factor(self.step + 1))
        compute_spans = self.stragglers.take()
        self.beat.phase("optimizer")
        # The loss summed over all ranks before the update (the skip decision needs it), in one
        # all-reduce with the attention work; cp and pp ranks count the same rows. (A fill, not a
        # copy from the host: a pageable copy would wait for the queued kernels.)
        totals = torch.stack([loss_sum, loss_sum.new_full((), float(attended_pairs))])
        for group in self.loss_groups:
            dist.all_reduce(totals, group=group)
        loss_sum = totals[0]
        rescale_expert_grads_(self.expert_params, self.mesh_spec, self.expert_grad_groups)
        copies = []
        if self.tied_copies is not None:
            self.tied_copies.sum_grads()
            copies = self.tied_copies.copies
        with torch.profiler.record_function(CLIP_RANGE):
            grad_norm = clip_grads_(self.parameters(), self.config.optim.grad_clip, self.pp_group, self.optimizer,
                                    copies=copies)
        decision = self.guard.decide(loss_sum, grad_norm)
        self.optimizer.found_inf = decision.found_inf
        lr = self.scheduler.get_last_lr()[0]
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            self.optimizer.step()
            if self.refresh_float8_scales:
                precision.after_optimizer_step(self.model_parts)  # from the weights as they now are
            if self.fp8_scaling is not None:
                self.fp8_scaling.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        router_stats = self.stats.after_moe_step(decision.found_inf)
        mtp_stats = self.stats.after_mtp_step()
        self.step += 1
        self.consumed_samples += d.global_batch
        # Waiting on an event releases the GIL (reading the loss does not): while the host waits for
        # the device, the watchdog and other threads run.
        done = timing_event(self.runtime.device)
        return LaunchedStep(self.step, launched_at, loss_sum, grad_norm, lr, router_stats, decision,
                            totals[1] / (self.mesh_spec.cp * self.mesh_spec.pp), compute_spans, done, mtp_stats,
                            data_s, device_from)

    def _read_back(self, launched: "LaunchedStep", at_once: bool = False) -> dict[str, float]:
        """The scalars of a launched step (waits for it). Its time runs from the previous step's
        read-back, or from its own launch if later (after an evaluation or a save), so in steady
        state it is the device's time per step. A step read back `at_once` after its launch (the
        last, or before an evaluation or a save) is timed from its launch: where launching waits
        for the device, the previous read-back came after this step had finished. The device's own
        time for the step, beside the time the host took to build its batches, tells a step the
        host holds up from one the device does."""
        device_s = None
        if launched.done is not None:
            launched.done.synchronize()
            device_s = launched.device_from.elapsed_time(launched.done) / 1e3
        decision = launched.decision
        # One transfer for the step's scalars.
        loss_sum, grad_norm, skipped, median, attended_pairs = torch.stack(
            [launched.loss_sum.float(), launched.grad_norm.float(), decision.found_inf, decision.median,
             launched.attended_pairs.float()]).tolist()
        loss = loss_sum / self.global_tokens
        now = time.perf_counter()
        elapsed = now - (launched.launched_at if at_once else max(self._last_read_back, launched.launched_at))
        self._last_read_back = now
        skip = self.guard.record(launched.step, bool(skipped), loss, grad_norm, median)
        if skip is not None:
            self.metrics.event("skip", launched.step, reason=skip, median=median)
        tokens_per_sec_per_gpu = self.global_tokens / elapsed / self.runtime.world_size
        scalars = {
            "train/loss": loss, "train/lr": launched.lr, "train/grad_norm": grad_norm,
            "train/skipped": skipped, "train/skipped_steps": self.guard.total_skipped,
            "perf/tokens_per_sec_per_gpu": tokens_per_sec_per_gpu,
            "perf/tokens_per_sec": self.global_tokens / elapsed, "perf/step_s": elapsed,
            "perf/data_s": launched.data_s, "mem/peak_gb": peak_memory_gb(self.runtime.device),
        }
        if device_s is not None:
            scalars["perf/device_s"] = device_s
        if launched.router_stats is not None:
            scalars.update(router_scalars(launched.router_stats))
        if launched.mtp_stats is not None:
            scalars.update(mtp_scalars(launched.mtp_stats))
        # The keys a query attended to, on average: each document's causal (windowed) attention only.
        attended_keys = attended_pairs / self.global_tokens
        scalars["perf/attended_keys_per_token"] = attended_keys
        if launched.compute_spans is not None:
            ratio, seconds, stages = self.stragglers.check(launched.step, launched.compute_spans)
            scalars["perf/straggler_ratio"] = ratio
            self.metrics.event("straggler_check", launched.step, seconds=seconds, stages=stages)
        if self.watchdog is not None:
            self.watchdog.step_done(launched.step, elapsed)
        if self.peak_flops is not None:
            scalars["perf/mfu"] = 100.0 * self.flops_per_token * tokens_per_sec_per_gpu / self.peak_flops
            needed = flops.flops_per_token(self.model_cfg, self.config.data.seq_len, attended_keys=attended_keys)
            scalars["perf/mfu_document_attention"] = 100.0 * needed * tokens_per_sec_per_gpu / self.peak_flops
        return scalars

    def fit(self, before_step=None) -> list[dict[str, float]]:
        """Steps until `--steps`; returns every step's scalars. `before_step(step)` is called
        before each step (benchmarks use it to start and stop the profiler).

        Step s+1 is queued before step s is read back, so reading the loss never leaves the device
        idle. A step is read back at once where its loss matters before going on: before an
        evaluation, a checkpoint save, and at the end."""
        total, history = self.config.train.steps, []
        unread: list[LaunchedStep] = []

        def read_back_all(evaluate: bool = False, at_once: bool = False) -> None:
            while unread:
                self.beat.phase("sync")
                launched = unread.pop(0)
                scalars = self._read_back(launched, at_once=at_once and not unread)
                if evaluate and not unread:
                    scalars["val/loss"] = self.evaluate()
                history.append(scalars)
                every = self.config.train.log_every
                console = (every and launched.step % every == 0) or launched.step == total
                self.metrics.log(launched.step, total, scalars, console=console)

        def before_save() -> None:
            read_back_all()
            self.beat.phase("checkpoint")
            self.metrics.flush()
            if self.watchdog is not None:
                self.watchdog.relax(until_step=self.step + 1)

        started = time.perf_counter()
        self.checkpointer.start()
        try:
            while self.step < total:
                if before_step is not None:
                    before_step(self.step)
                launched = self.launch_step()
                read_back_all()
                unread.append(launched)
                every = self.config.train.eval_every
                evaluate = bool(every) and (self.step % every == 0 or self.step == total)
                if evaluate or self.step == total or not self.overlap_read_back:
                    read_back_all(evaluate=evaluate, at_once=True)
                if self._step_boundary(before_save):
                    break  # preempted: saved, and every rank stops here
            read_back_all()
            self.beat.phase("checkpoint")
            if self.watchdog is not None:
                self.watchdog.relax(until_step=math.inf)
            self.checkpointer.finish(self.step)
        finally:
            self.checkpointer.close()
            self.metrics.close()
        if self.runtime.is_main:
            for line in closing_lines(run_dir=self.run_dir, step=self.step, total_steps=total,
                                      checkpoint=self.checkpointer.latest(), world_size=self.runtime.world_size,
                                      elapsed_s=time.perf_counter() - started,
                                      last_loss=history[-1]["train/loss"] if history else None,
                                      overwrite=self.config.train.overwrite):
                logger.info(line)
        return history

    def _step_boundary(self, before_save) -> bool:
        """Where the ranks agree to save or stop; True when the run stops (it saved first)."""
        reason = self.stop_request.poll()
        if reason is not None:
            self.checkpointer.request_stop(reason)
        self.beat.phase("sync")
        pending = self.checkpointer.pending
        stop = self.checkpointer.after_step(self.step, before_save=before_save)
        if self.watchdog is not None and self.checkpointer.pending is not pending:
            # A background save was committed or started: rank 0 may prune while the others go on.
            self.watchdog.relax(until_step=self.step + 1)
        if stop:
            self.stop_request.clear()
        return stop


@attrs.frozen
class LaunchedStep:
    """A step queued on the device: its results stay device tensors until read back."""

    step: int  # the number of updates done once it completes
    launched_at: float
    loss_sum: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    router_stats: moe.RouterStats | None
    decision: Decision
    attended_pairs: torch.Tensor  # query-key pairs attention needed over the global batch
    compute_spans: list | None = None  # the layers' forward times of a straggler check
    done: torch.cuda.Event | None = None  # recorded after the step's last kernel (GPUs)
    mtp_stats: mtp.MTPStats | None = None
    data_s: float = 0.0  # the host's time building the step's batches
    device_from: torch.cuda.Event | None = None  # recorded once the batches were built (GPUs)
