"""Faults on purpose, for tests and failure rehearsals; off unless `DTRAIN_FAULT` is set.

    DTRAIN_FAULT=crash@step5               every rank dies at step 5 (as from SIGKILL)
    DTRAIN_FAULT=hang@rank1:step3          rank 1 stops responding at step 3 (SIGSTOP)
    DTRAIN_FAULT=nan@step4,spike@rank0:step7
    DTRAIN_FAULT=oom@rank1:step2           rank 1 raises torch.OutOfMemoryError at step 2

KIND is `crash`, `hang`, `nan` (the step's loss, and so its gradients, become NaN), `spike` (the
step's loss is multiplied by 100) or `oom` (the step raises CUDA's out-of-memory error, as an
allocation that does not fit would). A fault fires the first time its step runs: it leaves a marker
in the run directory before it acts, so a run restarted from an earlier checkpoint passes the
same step without the fault again. Step S is the S-th optimizer step (the one logged as step S).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import attrs
import torch

from models.errors import UserError

ENV = "DTRAIN_FAULT"
KINDS = ("crash", "hang", "nan", "spike", "oom")
SPIKE_FACTOR = 100.0
MARKERS = "faults"  # under the run directory
_ENTRY = re.compile(r"^(?P<kind>[a-z]+)@(?:rank(?P<rank>\d+):)?step(?P<step>\d+)$")


@attrs.frozen
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank

    @property
    def name(self) -> str:
        return f"{self.kind}@{'' if self.rank is None else f'rank{self.rank}:'}step{self.step}"


def parse(text: str) -> list[Fault]:
    """The faults of a `DTRAIN_FAULT` value (comma-separated entries); a one-line error on a bad one."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        m = _ENTRY.match(entry)
        if m is None or m["kind"] not in KINDS:
            raise UserError(f"{ENV}={text!r}: bad entry {entry!r}; write KIND@stepS or KIND@rankR:stepS with "
                            f"KIND one of {', '.join(KINDS)}, e.g. crash@rank1:step5")
        faults.append(Fault(m["kind"], int(m["step"]), None if m["rank"] is None else int(m["rank"])))
    return faults


class FaultInjector:
    """This rank's faults of `DTRAIN_FAULT`. The trainer calls `at_step_start(step)` as a step
    begins and `loss_factor(step)` for what the step's loss is multiplied by (1.0 without a fault)."""

    def __init__(self, rank: int, run_dir: Path, text: str | None = None):
        text = os.environ.get(ENV, "") if text is None else text
        self.faults = [f for f in parse(text) if f.rank in (None, rank)]
        self.rank = rank
        self.markers = Path(run_dir) / MARKERS

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _take(self, step: int, kinds: tuple[str, ...]) -> list[Fault]:
        """The faults of `kinds` due at `step` that have not fired yet; marks them fired (durably,
        before they act: a crash must not fire again after the restart it causes)."""
        due = []
        for fault in self.faults:
            if fault.step != step or fault.kind not in kinds:
                continue
            marker = self.markers / f"{fault.name}.rank{self.rank}"
            if marker.exists():
                continue
            self.markers.mkdir(parents=True, exist_ok=True)
            with open(marker, "w") as f:
                f.write(f"{os.getpid()}\n")
                f.flush()
                os.fsync(f.fileno())
            due.append(fault)
        return due

    def at_step_start(self, step: int) -> None:
        for fault in self._take(step, ("crash", "hang", "oom")):
            print(f"dtrain: fault injection: {fault.name} on rank {self.rank}", flush=True)
            if fault.kind == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {ENV}={fault.name})")
            os.kill(os.getpid(), signal.SIGKILL if fault.kind == "crash" else signal.SIGSTOP)

    def loss_factor(self, step: int) -> float:
        factor = 1.0
        for fault in self._take(step, ("nan", "spike")):
            print(f"dtrain: fault injection: {fault.name} on rank {self.rank}", flush=True)
            factor *= float("nan") if fault.kind == "nan" else SPIKE_FACTOR
        return factor
