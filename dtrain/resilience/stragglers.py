"""Stragglers: ranks that compute slower than the others (a throttled or failing GPU, a busy host).

Every `--straggler-every` steps each rank times the forward computation of its layers in that
step: from the end of FSDP's wait for a layer's gathered parameters to the end of the layer's
forward. Waiting for peers is left out on purpose: in a synchronous step every rank's step time
is the slowest rank's, so only the time a rank spends on its own work tells the slow one apart.
GPUs time it with CUDA events read after the step's loss (no extra device sync); the CPU with the
host clock. One all-gather of two floats per rank over gloo (CPU tensors, never a device sync)
gives rank 0 every rank's time; TensorBoard gets `perf/straggler_ratio`, the slowest rank's time
over the median of the ranks doing the same work (a pipeline stage is compared with the same
stage of the other pipelines), and a warning names a rank that stays above RATIO_WARN x the
median for CHECKS_IN_A_ROW checks in a row.

With tp or ep > 1 a layer's forward holds collectives of its tensor- or expert-parallel group,
so a slow rank's group waits for it inside the layer and the whole group shows as slow.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("dtrain")

RATIO_WARN = 1.2
CHECKS_IN_A_ROW = 3


class StragglerTimer:
    """Times the forward of every layer module of `model_parts` on checked steps. Its hooks exist
    only during such a step (a module with hooks leaves nn.Module's fast call path), registered
    after FSDP's, so they run after its wait for the all-gather and after its reshard."""

    def __init__(self, model_parts: list[nn.Module], every: int, device: torch.device):
        self.every, self.device = every, device
        self.layers = [layer for part in model_parts for layer in (part.embed, *part.blocks.values(), part.head)
                       if layer is not None]
        self.spans: list[tuple] = []
        self._open: list = []
        self._hooks: list = []

    def arm(self, step: int) -> None:
        """Times step `step` when it is a checked one."""
        if self.every > 0 and step % self.every == 0:
            self.spans, self._open = [], []
            for layer in self.layers:
                self._hooks.append(layer.register_forward_pre_hook(self._start))
                self._hooks.append(layer.register_forward_hook(self._end))

    def take(self) -> list[tuple] | None:
        """The armed step's spans (read them with `seconds` once the step completed), or None."""
        if not self._hooks:
            return None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return self.spans

    def _now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module, args) -> None:
        self._open.append(self._now())

    def _end(self, module, args, output) -> None:
        if self._open:
            self.spans.append((self._open.pop(), self._now()))

    @staticmethod
    def seconds(spans: list[tuple]) -> float:
        if spans and isinstance(spans[0][0], float):
            return sum(end - start for start, end in spans)
        return sum(start.elapsed_time(end) for start, end in spans) / 1e3  # milliseconds


def gather(seconds: float, stage: int) -> tuple[list[float], list[int]]:
    """Every rank's (seconds, pipeline stage), through the CPU side of the default group."""
    mine = torch.tensor([seconds, float(stage)], dtype=torch.float64)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [seconds], [stage]
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [float(t[0]) for t in everyone], [int(t[1]) for t in everyone]


class StragglerReport:
    """Rank 0's view over the checks: the ratio of each check and who stays slow."""

    def __init__(self, ratio_warn: float = RATIO_WARN, checks_in_a_row: int = CHECKS_IN_A_ROW):
        self.ratio_warn, self.checks_in_a_row = ratio_warn, checks_in_a_row
        self.streaks: dict[int, list[int]] = {}  # rank -> the steps of its current run of slow checks

    def check(self, step: int, seconds: list[float], stages: list[int]) -> tuple[float, list[str]]:
        """(slowest / median, the warnings of this check). The median is the lower middle value
        (`median_low`): with two ranks the slow one is compared with the other, not with their mean."""
        medians = {stage: statistics.median_low([s for s, g in zip(seconds, stages) if g == stage])
                   for stage in set(stages)}
        ratios = [s / medians[g] if medians[g] > 0 else 1.0 for s, g in zip(seconds, stages)]
        warnings = []
        for rank, ratio in enumerate(ratios):
            if ratio <= self.ratio_warn:
                self.streaks.pop(rank, None)
                continue
            steps = self.streaks.setdefault(rank, [])
            steps.append(step)
            if len(steps) == self.checks_in_a_row:
                warnings.append(
                    f"straggler: rank {rank} computed {ratio:.2f}x the median time of its peers at the last "
                    f"{len(steps)} checks (steps {', '.join(map(str, steps))}); the whole job runs at its pace: "
                    f"check its GPU (clocks, temperature, errors: nvidia-smi -q) and its host")
        return max(ratios), warnings


class Stragglers:
    """The trainer's side: `arm(step)` before a step's forward, `take()` after it, and `check(step,
    spans)` once the step was read back (every rank: the all-gather is a collective)."""

    def __init__(self, model_parts: list[nn.Module], every: int, device: torch.device, *, stage: int,
                 is_main: bool):
        self.timer = StragglerTimer(model_parts, every, device)
        self.report = StragglerReport()
        self.stage, self.is_main = stage, is_main

    def arm(self, step: int) -> None:
        self.timer.arm(step)

    def take(self) -> list[tuple] | None:
        return self.timer.take()

    def check(self, step: int, spans: list[tuple]) -> tuple[float, list[float], list[int]]:
        """Every rank's compute time of step `step`; rank 0 warns of a rank that stays slow.
        Returns the slowest / median ratio, and every rank's seconds and pipeline stage."""
        seconds, stages = gather(StragglerTimer.seconds(spans), self.stage)
        ratio, warnings = self.report.check(step, seconds, stages)
        if self.is_main:
            for warning in warnings:
                logger.warning(warning)
        return ratio, seconds, stages
