"""Overlapped tensor + sequence parallelism (parallel/tensor_parallel.py): the collectives one block
issues, counted in a fake world of 2 ranks (no data moves, so values are not compared here), the
fused matmuls and loss against whole-tensor math on 2 gloo processes, the plan's region, and the
--tp-overlap choices. Loss parity of whole runs is in tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel import recompute, tensor_parallel
from tests.launch import run_cli, train_scalars
from tests.unit.test_tensor_parallel_overlap import SEQ, _block
from tests.unit.test_tensor_parallel_overlap import tp2  # noqa: F401  (a fixture of these tests)


COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _profiled_collectives(run) -> Counter:
    """The collectives `run()` issues, as the profiler sees them (it sees the ones DTensor issues
    inside its own dispatch too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = (e.name.partition("::") for e in prof.events())
    return Counter(op for namespace, _, op in names if namespace in ("_c10d_functional", "symm_mem")
                   and op in COLLECTIVES)


class _DispatchedCollectives(TorchDispatchMode):
    """The collectives that reach the dispatcher below any mode entered after this one: what
    selective recompute answers from its cache does not (unlike what the profiler records)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, op = func.name().partition("::")
        if namespace in ("_c10d_functional", "symm_mem") and op.split(".")[0] in COLLECTIVES:
            self.counts[op.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _dispatched_collectives(run) -> Counter:
    with _DispatchedCollectives() as mode:
        run()
    return mode.counts


def _collectives_per_phase(overlap: str | None, recompute_mode: str = "none",
                           count=_profiled_collectives) -> dict[str, Counter]:
    block_fn, params, x, aux, ctx = _block(overlap, recompute_mode)
    outputs = []
    forward = count(lambda: outputs.append(block_fn(params, x, aux, ctx).to_local()))
    backward = count(lambda: outputs[0].backward(torch.randn_like(outputs[0])))
    return {"forward": forward, "backward": backward}


def _calls(monkeypatch):
    """Records the width of each fused gather (number of weights) and scatter (number of sums)."""
    calls = []
    for name in ("all_gather_matmul", "matmul_reduce_scatter"):
        original = getattr(tensor_parallel, name)

        def recording(first, second, *rest, _name=name, _original=original):
            calls.append((_name, len(second) if _name == "all_gather_matmul" else len(first)))
            return _original(first, second, *rest)

        monkeypatch.setattr(tensor_parallel, name, recording)
    return calls


def test_overlapped_block_issues_one_gather_and_one_scatter_per_matmul_group(tp2, monkeypatch):
    calls = _calls(monkeypatch)
    counts = _collectives_per_phase("chunked")
    chunks = len(tensor_parallel.chunk_bounds(SEQ // 2, 2))
    assert chunks == 2
    # Forward: q/k/v share one gather, gate/up one; wo and w_down scatter their own outputs.
    # Backward: the mirror image. Each in tp chunks, and no collective outside them.
    assert calls == [("all_gather_matmul", 3), ("matmul_reduce_scatter", 1),
                     ("all_gather_matmul", 2), ("matmul_reduce_scatter", 1),
                     ("all_gather_matmul", 1), ("matmul_reduce_scatter", 2),
                     ("all_gather_matmul", 1), ("matmul_reduce_scatter", 3)], calls
    for phase in ("forward", "backward"):
        assert counts[phase] == Counter(all_gather_into_tensor=2 * chunks, reduce_scatter_tensor=2 * chunks), \
            (phase, counts[phase])


def test_unfused_block_issues_dtensor_collectives(tp2, monkeypatch):
    """The same count without overlap: what the test above would see if the fused path were
    silently skipped (one whole gather per matmul group, one reduce-scatter per residual add)."""
    calls = _calls(monkeypatch)
    counts = _collectives_per_phase(None)
    assert calls == []
    assert counts["forward"] == Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2), counts


def test_selective_recompute_keeps_the_fused_collectives(tp2):
    totals = {mode: sum(_collectives_per_phase("chunked", mode, _dispatched_collectives)["backward"].values())
              for mode in recompute.RECOMPUTE_MODES}
    assert totals["selective"] == totals["none"] > 0, totals
    assert totals["full"] > totals["none"], totals  # full recompute gathers and scatters again


@pytest.mark.slow
def test_fused_matmuls_and_vocab_parallel_loss_match_whole_tensor_math():
    result = run_cli(["chunked"], nproc=2, module="tests.workers.tp_overlap")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend", [[], ["inductor"]], ids=["eager", "compiled"])
def test_symmetric_memory_matmuls_run_and_match_whole_tensor_math_on_two_gpus(backend):
    """torch's fused ops, called (the worker profiles them) and right, forward and backward."""
    result = run_cli(["symm_mem", *backend], nproc=2, module="tests.workers.tp_overlap")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_compiled_symmetric_memory_training_matches_unfused_on_two_gpus(tmp_path):
    """Whole compiled runs, fp32 (no TF32: both runs use the same GEMMs), 10 steps: --tp-overlap
    auto resolves to symm_mem on GPUs; its losses against DTensor's separate collectives."""
    sp = ["--mesh", "tp=2", "--sequence-parallel", "--compile"]
    fused = train_scalars(tmp_path / "fused", sp, nproc=2)
    unfused = train_scalars(tmp_path / "unfused", [*sp, "--tp-overlap", "none"], nproc=2)
    for step, (a, e) in enumerate(zip(fused["train/loss"], unfused["train/loss"], strict=True), 1):
        assert abs(a - e) <= 1e-4 * abs(e), f"loss at step {step}: symm_mem {a} vs unfused {e}"
