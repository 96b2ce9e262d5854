"""A finished (or failed) run as diagnosis reads it: its configuration, its journal, its failures,
and the planner's target for the GPUs it ran on."""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import attrs

from dtrain.config import Config, load_config
from dtrain.diagnose import journal
from dtrain.layout import Machine, RunLayout, resolve
from dtrain.planner import advice, gpus
from dtrain.planner.candidates import Target
from dtrain.resilience import failures
from models.errors import UserError

# Steps after each start left out of the timing: compilation, autotuning, the allocator's growth.
WARMUP_STEPS = 2


@attrs.frozen
class RunRecord:
    run_dir: Path
    config: Config
    journal: journal.Journal
    failures: list[failures.Failure]

    @property
    def start(self) -> dict:
        """The last start line: the world and GPU the run's latest steps ran on."""
        return self.journal.last_start

    @property
    def world_size(self) -> int:
        return int(self.start["world_size"])

    @property
    def device(self) -> str:
        return self.start.get("device", "cpu")

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def gpu(self) -> str:
        """The planner's profile of the run's GPU (its default on a CPU run)."""
        return self.start.get("gpu", gpus.DEFAULT)

    @property
    def gpu_memory_gb(self) -> float:
        return float(self.start.get("gpu_memory_gb", advice.DEFAULT_GPU_MEMORY_GB))

    @functools.cached_property
    def layout(self) -> RunLayout:
        """The run's options resolved as the run resolved them: on GPUs of its profile, or the CPU
        (a `UserError` where this version of dtrain refuses them)."""
        machine = Machine.gpu_profile(self.gpu) if self.on_gpu else Machine()
        return resolve(self.config, self.world_size, machine)

    @property
    def target(self) -> Target:
        """The planner's target for this run's model, data shape and GPUs (no choice fixed)."""
        return advice.target_of(self.config, self.world_size, gpu=self.gpu, memory_gb=self.gpu_memory_gb,
                                per_node=int(self.start.get("gpus_per_node", 8)))

    @property
    def steps(self) -> list[dict]:
        return self.journal.steps

    def timed_steps(self) -> list[dict]:
        """The step lines that time the run: not the first WARMUP_STEPS after any start, nor skipped
        updates (a skipped step does less work)."""
        starts = [int(s["step"]) for s in self.journal.starts]
        return [s for s in self.steps
                if not s.get("skipped") and not any(0 < s["step"] - start <= WARMUP_STEPS for start in starts)]

    def median(self, name: str, steps: list[dict] | None = None) -> float | None:
        values = [s[name] for s in (self.timed_steps() if steps is None else steps) if name in s]
        return statistics.median(values) if values else None


def load(run_dir: Path) -> RunRecord:
    """The run in `run_dir`; a one-line error where it is not a run directory dtrain wrote."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise UserError(f"{run_dir} has no config.toml: pass the --run-dir of a dtrain run")
    config = load_config(["--config", str(config_path)])
    record, failed = journal.read(run_dir), failures.read(run_dir)
    if not record.starts:
        if not failed:
            raise UserError(f"{run_dir} has no {journal.JOURNAL} with a start line (runs of dtrain from before the "
                            f"journal wrote none): train into it again, or pass another run directory")
        record = attrs.evolve(record, starts=[_start_of_failed(config, failed)])
    return RunRecord(run_dir, config, record, failed)


def _start_of_failed(config: Config, failed: list[failures.Failure]) -> dict:
    """What a run that failed before its start line (while it built the model) still tells: its
    ranks from their failure records, a GPU where the error was CUDA's."""
    on_gpu = any("CUDA" in f.what or "cuda" in f.what for f in failed)
    return {"event": "start", "step": 0, "world_size": max(f.rank for f in failed) + 1,
            "device": "CUDA" if on_gpu else "cpu", "from_failures": True,
            "gpu_memory_gb": config.parallel.gpu_memory_gb or advice.DEFAULT_GPU_MEMORY_GB}
