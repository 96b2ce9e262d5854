"""Throughput, MFU, memory, the console line and TensorBoard."""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
from pathlib import Path

import torch

from dtrain.diagnose.journal import JournalWriter
from models.moe import RouterStats
from models.mtp import MTPStats

logger = logging.getLogger("dtrain")

# Dense BF16 peak FLOP/s per GPU from the datasheets (never the sparsity figures), matched by name.
PEAK_BF16_FLOPS = (
    ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("A10G", 70e12), ("MI300X", 1307e12), ("MI325X", 1307e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense BF16 peak, or None (MFU is then not reported) when it is not known."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """The dense BF16 peak of a GPU by its name ("NVIDIA H200"), or None when it is not known."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def router_scalars(stats: RouterStats) -> dict[str, float]:
    """A step's MoE router statistics as logged: mean router losses, dropped fraction and load
    imbalance (max / mean expert load: 1 is perfect balance, num_experts / top_k is everything on
    top_k experts), overall and per layer."""
    if not stats.load:
        return {}
    totals = torch.stack(list(stats.totals.values())).cpu()
    load = torch.stack(list(stats.load.values())).cpu()
    imbalance = load.max(-1).values / load.mean(-1).clamp_min(1e-20)
    records = totals[:, 4].clamp_min(1)
    out = {
        "moe/aux_loss": (totals[:, 2] / records).mean().item(),
        "moe/z_loss": (totals[:, 3] / records).mean().item(),
        "moe/dropped_fraction": (totals[:, 1].sum() / totals[:, 0].sum().clamp_min(1)).item(),
        "moe/imbalance_max": imbalance.max().item(),
        "moe/imbalance_mean": imbalance.mean().item(),
    }
    out.update({f"moe/imbalance/layer_{layer}": v.item() for layer, v in zip(stats.load, imbalance)})
    return out


def mtp_scalars(stats: MTPStats) -> dict[str, float]:
    """`train/mtp_loss`: the mean cross-entropy per label of multi-token prediction, averaged over
    the depths; and each depth's own (`train/mtp_loss/depth_k`, k from 1) when there are several."""
    if not stats.totals:
        return {}
    per_depth = {k: (t[0] / t[1].clamp_min(1)).item() for k, t in sorted(stats.totals.items())}
    out = {"train/mtp_loss": sum(per_depth.values()) / len(per_depth)}
    if len(per_depth) > 1:
        out.update({f"train/mtp_loss/depth_{k + 1}": v for k, v in per_depth.items()})
    return out


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the peak resident memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kilobytes * (1 if sys.platform != "darwin" else 1 / 1024) / 1e6


def timing_event(device: torch.device) -> torch.cuda.Event | None:
    """A CUDA event that times, recorded now on the current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextlib.contextmanager
def log_file(path: Path, enabled: bool):
    """Copies dtrain's log lines into `path` (the run directory's train.log) while open."""
    if not enabled:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()


class MetricsLogger:
    """Console lines on rank 0, TensorBoard scalars under `run_dir/tensorboard`, and the journal
    that `python -m dtrain.diagnose` reads (`run_dir/metrics.jsonl`: each step's line and the
    run's events)."""

    def __init__(self, run_dir: Path, enabled: bool, peak: float | None, device: torch.device,
                 start_step: int = 0):
        self.enabled = enabled
        self.writer = self.journal = None
        if enabled:
            self.journal = JournalWriter(run_dir)
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run drops the events a previous run logged after its checkpoint.
            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                        purge_step=start_step + 1 if start_step else None)
            if peak is None and device.type == "cuda":
                logger.warning("MFU is not reported: no known peak FLOP/s for %s", torch.cuda.get_device_name(device))
        # On GPUs throughput is per GPU (the peers' unit); elsewhere the run's, all processes together.
        self.per_gpu = device.type == "cuda"

    def log(self, step: int, total_steps: int, scalars: dict[str, float], console: bool) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.journal.step(step, scalars)
        if console:
            logger.info(format_line(step, total_steps, scalars, per_gpu=self.per_gpu))

    def event(self, kind: str, step: int, **fields) -> None:
        """A line of the journal for something that happened at `step` (a start, a skipped update,
        a straggler check); rank 0's only."""
        if self.enabled:
            self.journal.event(kind, step, **fields)

    def flush(self) -> None:
        """Onto the disk now: a checkpoint flushes the steps before it, so that a run killed later
        and resumed from it keeps them."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.journal.close()


def format_line(step: int, total_steps: int, s: dict[str, float], per_gpu: bool = True) -> str:
    """The console line of a step; `per_gpu`: throughput per GPU, else the run's (perf/tokens_per_sec)."""
    throughput = (f"tok/s/GPU {s['perf/tokens_per_sec_per_gpu']:,.0f}" if per_gpu
                  else f"tok/s {s['perf/tokens_per_sec']:,.0f}")
    parts = [
        f"step {step:>{len(str(total_steps))}}/{total_steps}",
        f"loss {s['train/loss']:.4f}",
        *([f"val loss {s['val/loss']:.4f}"] if "val/loss" in s else []),
        f"lr {s['train/lr']:.2e}",
        f"grad norm {s['train/grad_norm']:.3f}",
        throughput,
    ]
    if "perf/mfu" in s:
        parts.append(f"MFU {s['perf/mfu']:.1f}%")
    parts.append(f"mem {s['mem/peak_gb']:.2f} GB")
    if s.get("train/skipped"):
        parts.append("update skipped")
    return " | ".join(parts)
