"""The collectives of expert parallelism and of sequence parallelism's chunked matmuls, repeated
hundreds of times in one gloo group (issue 25: with functional collectives left in flight
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
def test_exchange_survives_hundreds_of_iterations_with_fsdp_between(tmp_path, monkeypatch):
    # Freed heap memory filled with a byte pattern: a late write or read through a dead buffer
    # shows as a crash or a wrong result sooner (glibc reads it when each process starts).
    monkeypatch.setenv("MALLOC_PERTURB_", "165")
    mp.spawn(ep_stress.main, args=(str(tmp_path), ITERATIONS), nprocs=ep_stress.WORLD, join=True)
    for rank in range(ep_stress.WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["iterations"] == ITERATIONS
        assert result["max_relative_error"] <= RTOL, f"rank {rank}: {result}"


@pytest.mark.stress
@pytest.mark.timeout(3600)
def test_chunked_tensor_parallel_matmuls_survive_hundreds_of_iterations(tmp_path, monkeypatch):
    """The same hunt for sequence parallelism's chunked all-gather and reduce-scatter matmuls
    (tests/workers/tp_stress.py)."""
    monkeypatch.setenv("MALLOC_PERTURB_", "165")
    mp.spawn(tp_stress.main, args=(str(tmp_path), ITERATIONS), nprocs=tp_stress.WORLD, join=True)
    for rank in range(tp_stress.WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["iterations"] == ITERATIONS
        assert result["max_relative_error"] <= RTOL, f"rank {rank}: {result}"
