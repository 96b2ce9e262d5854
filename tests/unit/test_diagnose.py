"""`python -m dtrain.diagnose`: tiny CPU runs with one planted fault each (a NaN and a loss spike, a
slow data loader, a too-small micro-batch, an out-of-memory error, a straggling rank), each read
back and named for what it is, and a healthy run in which nothing is named."""

from __future__ import annotations

import math

import attrs
import pytest

from dtrain.diagnose import journal


def test_every_start_of_a_run_is_in_the_journal(tmp_path):
    """The reader keeps the steps that stand; a half-written last line (a killed run) is skipped."""
    writer = journal.JournalWriter(tmp_path)
    writer.event("start", 0, attempt=[0, 0])
    for step in (1, 2, 3):
        writer.step(step, {"train/loss": float(10 - step), "train/grad_norm": math.nan, "perf/step_s": 1.0})
    writer.event("start", 2, attempt=[0, 1])
    writer.step(3, {"train/loss": 6.5, "train/grad_norm": math.inf})
    writer.close()
    with open(tmp_path / journal.JOURNAL, "a") as f:
        f.write('{"step": 4, "lo')
    record = journal.read(tmp_path)
    assert [(s["step"], s["loss"]) for s in record.steps] == [(1, 9.0), (2, 8.0), (3, 6.5)]
    assert math.isnan(record.steps[0]["grad_norm"]) and record.steps[2]["grad_norm"] == math.inf
    assert len(record.starts) == 2 and attrs.astuple(record.restarts[0])[:3] == (2, 3, (0, 1))
    # The same command again in the same directory, from step 0: another run.
    writer = journal.JournalWriter(tmp_path)
    writer.event("start", 0, attempt=[0, 0])
    writer.step(1, {"train/loss": 5.0})
    writer.close()
    record = journal.read(tmp_path)
    assert [(s["step"], s["loss"]) for s in record.steps] == [(1, 5.0)] and len(record.starts) == 1
    assert record.restarts == [] and record.events == []


def test_on_a_gpu_only_the_devices_idle_time_can_go_to_the_batches():
    from dtrain.diagnose.speed import exposed_data_s

    # The device busy for all of the step: the batches were built while it ran the step before.
    assert exposed_data_s({"step_s": 0.5, "data_s": 0.2, "device_s": 0.5}) == 0.0
    # Idle for 0.07 s of the step: no more of the 0.15 s the batches took held it up.
    assert exposed_data_s({"step_s": 0.17, "data_s": 0.15, "device_s": 0.1}) == pytest.approx(0.07)
    assert exposed_data_s({"step_s": 0.5, "data_s": 0.01, "device_s": 0.2}) == 0.01
    assert exposed_data_s({"step_s": 0.5, "data_s": 0.2}) == 0.2  # the CPU: the host does everything
