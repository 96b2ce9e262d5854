"""The collectives of expert parallelism and of sequence parallelism's chunked matmuls, repeated
hundreds of times in one gloo group (with functional collectives left in flight
together, runs on gloo crashed now and then). Outside the default run; `python -m pytest -m
stress` runs them (minutes on 2 cores, more under load). tests/workers/ep_stress.py and
tests/workers/tp_stress.py say what each iteration does."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from tests.workers import ep_stress, tp_stress


ITERATIONS = 200
RTOL = 1e-5


@pytest.mark.stress
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("worker", [ep_stress, tp_stress], ids=["expert-parallel exchange", "chunked tp matmuls"])
def test_collectives_survive_hundreds_of_iterations(tmp_path, monkeypatch, worker):
    # Freed heap memory filled with a byte pattern: a late write or read through a dead buffer
    # shows as a crash or a wrong result sooner (glibc reads it when each process starts).
    monkeypatch.setenv("MALLOC_PERTURB_", "165")
    mp.spawn(worker.main, args=(str(tmp_path), ITERATIONS), nprocs=worker.WORLD, join=True)
    for rank in range(worker.WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["iterations"] == ITERATIONS
        assert result["max_relative_error"] <= RTOL, f"rank {rank}: {result}"
