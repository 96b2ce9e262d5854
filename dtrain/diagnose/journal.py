"""The run's journal, RUN_DIR/metrics.jsonl: what `python -m dtrain.diagnose` reads back.

Rank 0 appends one JSON object per line and flushes it, so a run killed at any moment leaves
every line but its last whole:

    {"event": "start", "step": 0, "attempt": [0, 0], "world_size": 8, "device": "NVIDIA H200", "gpu": "h200",
     "gpu_memory_gb": 150.0, "gpus_per_node": 8, "time": 1767312000.0, "layout": {the planner's view}}
    {"step": 1, "time": 1767312003.2, "loss": 10.41, "grad_norm": 3.2, "lr": 1.5e-05, "skipped": 0, "step_s": 0.41,
     "data_s": 0.002, "device_s": 0.40, "peak_gb": 61.2, "tokens_per_s": 9876.0, "mfu": 41.2}
    {"event": "skip", "step": 5, "reason": "non-finite", "median": "nan"}
    {"event": "straggler_check", "step": 50, "seconds": [0.21, 0.29], "stages": [0, 0]}

A step line holds what the metrics logger already read back (nothing here waits for the GPU):
`step_s` the step's wall time, `data_s` the host's time building its batches, `device_s` the GPU's
time from then to the step's last kernel (CUDA events read once the step is done: GPUs only),
`peak_gb` the peak memory so far, `tokens_per_s` per GPU, `mfu` in percent (GPUs of known peak). Non-finite numbers are the strings "nan",
"inf" and "-inf" (strict JSON has none). Every start of the run appends a start line: a restart
resumes at its `step`, and the lines of the steps after it that came before it were redone; a start
at step 0 of a first attempt (neither restarted nor resumed) begins another run, and the reader
leaves out what came before it.
Failures (an out-of-memory error, a hang, a lost rank) are each rank's records in
RUN_DIR/failures/ (dtrain/resilience/failures.py), which any rank writes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import attrs
import torch

from dtrain.layout import RunLayout
from dtrain.planner import advice
from dtrain.resilience.failures import attempt

logger = logging.getLogger("dtrain")

JOURNAL = "metrics.jsonl"

# The metrics logger's scalars a step line keeps, under shorter names.
STEP_FIELDS = {
    "train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr", "train/skipped": "skipped",
    "perf/step_s": "step_s", "perf/data_s": "data_s", "perf/device_s": "device_s", "mem/peak_gb": "peak_gb",
    "perf/tokens_per_sec_per_gpu": "tokens_per_s", "perf/mfu": "mfu", "perf/straggler_ratio": "straggler_ratio",
    "val/loss": "val_loss",
}

# Figures kept to the digits that mean something (losses, norms and the lr keep theirs).
ROUNDED = {"step_s": 6, "data_s": 6, "device_s": 6, "peak_gb": 4, "tokens_per_s": 1, "mfu": 3, "skipped": 0}


def _encode(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


def _decode(value):
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


class JournalWriter:
    """Appends lines to RUN_DIR/metrics.jsonl (rank 0 only). A journal that cannot be written
    warns once and stops writing: diagnosis must never stop a run."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / JOURNAL
        try:
            self.file = open(self.path, "a")
            if self.file.tell() and _last_byte(self.path) != b"\n":
                self.file.write("\n")  # after a run killed mid-line: that line stays alone, and unread
        except OSError as error:
            logger.warning("no run journal (%s): python -m dtrain.diagnose will have less to read", error)
            self.file = None

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(_encode(record)) + "\n")
            self.file.flush()
        except OSError as error:
            logger.warning("the run journal stops here (%s)", error)
            self.file = None

    def step(self, step: int, scalars: dict[str, float]) -> None:
        fields = {name: scalars[tag] for tag, name in STEP_FIELDS.items() if tag in scalars}
        for name, digits in ROUNDED.items():
            if name in fields and math.isfinite(fields[name]):
                fields[name] = round(fields[name], digits)
        self.write({"step": step, "time": round(time.time(), 3), **fields})

    def event(self, kind: str, step: int, **fields) -> None:
        self.write({"event": kind, "step": step, "time": round(time.time(), 3), **fields})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def start_fields(layout: RunLayout, device: torch.device) -> dict:
    """What a start line records besides its step: the attempt, the world, the GPU and the layout."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"attempt": list(attempt()), "world_size": layout.world_size, "device": name, "gpu": layout.machine.gpu,
            "gpu_memory_gb": round(advice.gpu_memory_gb(layout.config), 2), "gpus_per_node": advice.gpus_per_node(),
            "layout": layout_record(layout)}


def layout_record(layout: RunLayout) -> dict:
    """The run's layout as the planner sees it (mesh, micro-batch, recompute, data-parallel mode,
    memory per rank and step time on this GPU), or {"error": why} where it cannot say."""
    try:
        return advice.evaluate(layout).as_json()
    except Exception as error:  # a layout the planner cannot model must not stop the run
        return {"error": f"{type(error).__name__}: {error}"}


@attrs.frozen
class Restart:
    """A start after the first: it resumed at `step` once the run had reached `reached`."""

    step: int
    reached: int
    attempt: tuple[int, ...]
    time: float
    gap_s: float  # from the last step line before it to the first step line after it


@attrs.frozen
class Journal:
    """A run's journal read back: the start lines, the step lines that stand (a restart's redone
    steps replace the earlier ones), and the event lines, in the order they were written."""

    starts: list[dict]
    steps: list[dict]
    events: list[dict]
    restarts: list[Restart]

    @property
    def first_start(self) -> dict:
        return self.starts[0] if self.starts else {}

    @property
    def last_start(self) -> dict:
        return self.starts[-1] if self.starts else {}

    def series(self, name: str) -> list[float]:
        return [s[name] for s in self.steps if name in s]

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def read(run_dir: Path) -> Journal:
    """The journal of `run_dir` (empty where the run wrote none); lines that do not parse (the
    half-written last line of a killed run) are skipped."""
    path = Path(run_dir) / JOURNAL
    starts, events, restarts = [], [], []
    by_step: dict[int, dict] = {}
    last_step_time = None
    pending: dict | None = None  # a restart waiting for its first step line
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            record = _decode(json.loads(line))
            step = int(record["step"])
        except (ValueError, TypeError, KeyError):
            continue
        kind = record.get("event")
        if kind is None:
            by_step[step] = record
            if pending is not None:
                restarts.append(Restart(pending["step"], pending["reached"], tuple(pending.get("attempt", ())),
                                        pending.get("time", 0.0), record.get("time", 0.0) - pending["since"]))
                pending = None
            last_step_time = record.get("time")
            continue
        if kind == "start":
            if step == 0 and list(record.get("attempt", [])) == [0, 0]:
                # A new run in the same directory (not restarted, not resumed): what came before is another run's.
                starts, events, restarts, by_step, pending, last_step_time = [], [], [], {}, None, None
            elif starts:
                reached = max(by_step, default=0)
                pending = {**record, "reached": reached, "since": last_step_time or record.get("time", 0.0)}
                by_step = {s: r for s, r in by_step.items() if s <= step}
            starts.append(record)
        else:
            events.append(record)
    if pending is not None:  # a restart that logged no step
        restarts.append(Restart(pending["step"], pending["reached"], tuple(pending.get("attempt", ())),
                                pending.get("time", 0.0), math.nan))
    return Journal(starts, [by_step[s] for s in sorted(by_step)], events, restarts)
