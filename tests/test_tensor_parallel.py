"""Tensor and sequence parallelism from the plan alone: loss parity against one process
(CPU, gloo, fp32, 10 steps, relative difference <= 1e-4 at every step)."""

import pytest

from tests.launch import run_cli, train_scalars

LOSS_RTOL = 1e-4

CASES = [
    # (extra flags of both runs, mesh flags of the parallel run, processes)
    ([], ["--mesh", "tp=2"], 2),
    ([], ["--mesh", "tp=2", "--sequence-parallel"], 2),
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


@pytest.mark.slow
@pytest.mark.parametrize("common,mesh,nproc", CASES, ids=[" ".join(c + m) for c, m, _ in CASES])
def test_tensor_parallel_matches_one_process(tmp_path, single_run, common, mesh, nproc):
    reference = single_run if not common else train_scalars(tmp_path / "single", common)
    parallel = train_scalars(tmp_path / "parallel", common + mesh, nproc=nproc)
    _assert_close(parallel["train/loss"], reference["train/loss"], f"loss on {' '.join(mesh)}")
    _assert_close(parallel["train/grad_norm"], reference["train/grad_norm"], f"grad norm on {' '.join(mesh)}")


@pytest.mark.slow
def test_full_vocabulary_logits_never_exist_on_a_rank():
    result = run_cli([], nproc=2, module="tests.workers.tp_logits")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
