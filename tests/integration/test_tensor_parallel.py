"""Tensor and sequence parallelism from the plan alone: loss parity against one process
(CPU, gloo, fp32, 10 steps, relative difference <= 1e-4 at every step). Sequence parallelism runs
with its collectives fused into the matmuls (--tp-overlap, chunked on CPU) unless told not to."""

import pytest

from tests.launch import TINY_ARGS, run_cli, scalars, train_scalars


LOSS_RTOL = 1e-4

CASES = [
    # (extra flags of both runs, mesh flags of the parallel run, processes)
    ([], ["--mesh", "tp=2"], 2),
    ([], ["--mesh", "tp=2", "--sequence-parallel"], 2),
    ([], ["--mesh", "tp=2", "--sequence-parallel", "--tp-overlap", "none"], 2),
    ([], ["--mesh", "dp=2,tp=2"], 4),
    ([], ["--mesh", "dp_replicate=2,tp=2", "--sequence-parallel", "--recompute", "selective"], 4),
    # An odd vocabulary: shards of 1024 and 1023 rows, the loss exactly the unsplit model's.
    (["--data", "synthetic", "--model-overrides", "vocab_size=2047"], ["--mesh", "tp=2"], 2),
    # One KV head for tp=2: K/V projections replicated, each rank attends with the head it needs.
    (["--model-overrides", "num_kv_heads=1"], ["--mesh", "tp=2", "--sequence-parallel"], 2),
]


def _assert_close(actual, expected, what):
    assert len(actual) == len(expected) == 10, what
    for step, (a, e) in enumerate(zip(actual, expected), 1):
        assert abs(a - e) <= LOSS_RTOL * abs(e), f"{what} at step {step}: {a} vs one process {e}"


# Runs of this module by their flags, so that later tests compare runs the parity test made.
_RUNS: dict[tuple[str, ...], dict[str, list[float]]] = {}


def _run(tmp_path, flags: list[str], nproc: int) -> dict[str, list[float]]:
    if tuple(flags) not in _RUNS:
        _RUNS[tuple(flags)] = train_scalars(tmp_path / "parallel", flags, nproc=nproc)
    return _RUNS[tuple(flags)]


@pytest.mark.slow
@pytest.mark.parametrize("common,mesh,nproc", CASES, ids=[" ".join(c + m) for c, m, _ in CASES])
def test_tensor_parallel_matches_one_process(tmp_path, single_run, common, mesh, nproc):
    reference = single_run if not common else train_scalars(tmp_path / "single", common)
    parallel = _run(tmp_path, common + mesh, nproc)
    _assert_close(parallel["train/loss"], reference["train/loss"], f"loss on {' '.join(mesh)}")
    _assert_close(parallel["train/grad_norm"], reference["train/grad_norm"], f"grad norm on {' '.join(mesh)}")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [[], ["--tp-overlap", "none"]], ids=["overlapped", "unfused"])
def test_full_vocabulary_logits_never_exist_on_a_rank(overlap):
    result = run_cli(overlap, nproc=2, module="tests.workers.tp_logits")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.slow
def test_overlapped_sequence_parallel_matches_unfused(tmp_path):
    """The fused all-gather/reduce-scatter matmuls against DTensor's separate collectives, step by
    step: the same sums in another order, so closer to each other than either is to one process."""
    sp = ["--mesh", "tp=2", "--sequence-parallel"]
    fused, unfused = _run(tmp_path / "fused", sp, 2), _run(tmp_path / "unfused", [*sp, "--tp-overlap", "none"], 2)
    for tag in ("train/loss", "train/grad_norm"):
        for step, (a, e) in enumerate(zip(fused[tag], unfused[tag]), 1):
            assert abs(a - e) <= 1e-5 * abs(e), f"{tag} at step {step}: overlapped {a} vs unfused {e}"


@pytest.mark.slow
@pytest.mark.timeout(600)  # compilation on two processes
def test_compiled_overlapped_sequence_parallel_matches_one_process(tmp_path, single_run):
    """--compile: the fused matmuls and the vocab-parallel loss inside the compiled blocks and head,
    compiled at most twice per function (tests/workers/strict_recompiles.py)."""
    run_dir = tmp_path / "compiled"
    result = run_cli([*TINY_ARGS, "--run-dir", str(run_dir), "--steps", "4", "--compile", "--mesh", "tp=2",
                      "--sequence-parallel", "--tp-overlap", "chunked"], nproc=2, module="tests.workers.strict_recompiles")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    losses = scalars(run_dir)["train/loss"]
    assert len(losses) == 4
    for step, (a, e) in enumerate(zip(losses, single_run["train/loss"]), 1):
        assert abs(a - e) <= LOSS_RTOL * abs(e), f"loss at step {step}: compiled tp=2 SP {a} vs one process {e}"
