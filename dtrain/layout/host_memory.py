"""Whether a CPU run fits in its hosts' memory, asked of the planner's memory model before the
model is built: a model too large for the host is one line that says what it needs, not minutes of
allocation that the kernel's out-of-memory killer ends without a word.

    check_host_memory(config, rank, world_size, device_type)  # every rank, before the model is built
    host_memory_problem(config, needs)                        # the decision, on what every rank reported

Each rank predicts its own peak (`rank_need_bytes`: weights, gradients, AdamW's moments, the
activations of its micro-batches, as dtrain/planner/memory.py models them with the CPU's kernels)
and reads what its host has left (`available_bytes`); the ranks of a host share its memory. Every
rank decides on what all of them reported, so all refuse or none does.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import attrs
import torch.distributed as dist

from dtrain.config import Config
from dtrain.layout.run_layout import RunLayout
from models.errors import UserError

GB = 1e9


@attrs.frozen
class RankNeed:
    host: str
    need: float  # bytes this rank's process will hold at its peak
    available: float  # bytes its host had left when it looked (inf: unknown)


def readable(size: float) -> str:
    return f"{size / GB:.1f} GB" if size >= 0.1 * GB else f"{size / 1e6:.1f} MB"


def rank_need_bytes(layout: RunLayout, rank: int) -> float:
    """The memory model's peak of `rank` on the CPU, without the GPU libraries' workspaces and with
    what --cpu-offload moves to host memory (all of it is host memory here)."""
    from dtrain.planner.activations import CPU
    from dtrain.planner.memory import predict_workload
    from dtrain.planner.workload import workload

    breakdown = predict_workload(workload(layout, rank), CPU)
    return breakdown.total - breakdown.workspace + breakdown.host


def _meminfo_bytes(text: str, key: str) -> float | None:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == key and value.split():
            return float(value.split()[0]) * 1024  # kB
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def available_bytes(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> float:
    """What this process's host (or its container's memory limit, if lower) can still give: free
    memory and swap, as the out-of-memory killer counts them (inf where neither can be read)."""
    found = []
    meminfo = _read(proc / "meminfo")
    if meminfo is not None and (memory := _meminfo_bytes(meminfo, "MemAvailable")) is not None:
        found.append(memory + (_meminfo_bytes(meminfo, "SwapFree") or 0.0))
    # cgroup v2 where it is mounted, else v1: the limit ("max": none) less what the group uses.
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit, usage = _read(cgroup / limit_file), _read(cgroup / usage_file)
        if limit is None or usage is None:
            continue
        if limit.strip().isdigit() and usage.strip().isdigit():
            found.append(float(limit) - float(usage))
        break
    return min(found, default=math.inf)


def host_memory_problem(config: Config, needs: list[RankNeed]) -> str | None:
    """The refusal, where the ranks of a host need more than it has (the first such host); None
    where every host has room."""
    by_host: dict[str, list[RankNeed]] = {}
    for need in needs:
        by_host.setdefault(need.host, []).append(need)
    for host, ranks in by_host.items():
        need, available = sum(r.need for r in ranks), min(r.available for r in ranks)
        if need > available:
            processes = f"{len(ranks)} processes" if len(ranks) > 1 else "1 process"
            return (f"--model {config.model.model} needs {readable(need)} of host memory on {host} ({processes}: "
                    f"weights, gradients, AdamW's moments and activations, by the memory model) but it has "
                    f"{readable(available)} available; choose a smaller --model (or --model-overrides), or "
                    f"inspect this one with --dry-run, which allocates nothing")
    return None


def check_host_memory(layout: RunLayout, rank: int, device_type: str) -> None:
    """A CPU run whose ranks would not fit in their hosts' memory stops here, on every rank alike
    (GPU runs keep their weights in GPU memory: the out-of-memory report covers those)."""
    if device_type != "cpu":
        return
    world_size = layout.world_size
    own = RankNeed(socket.gethostname(), rank_need_bytes(layout, rank), available_bytes())
    needs = [own]
    if dist.is_initialized() and world_size > 1:
        needs = [None] * world_size
        dist.all_gather_object(needs, own)
    problem = host_memory_problem(layout.config, needs)
    if problem is not None:
        raise UserError(problem)
