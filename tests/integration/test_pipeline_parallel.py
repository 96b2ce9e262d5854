"""Pipeline parallelism: loss parity of every schedule against one process (CPU, gloo, fp32,
10 steps, relative difference <= 1e-4 at every step), the splitter, bad layouts, the micro-batches
each schedule holds at once, and the number of micro-batches taken without --global-batch."""

import pytest

from tests.launch import train_scalars


LOSS_RTOL = 1e-4


CASES = [
    (["--mesh", "pp=2"], 2),                                                   # 1f1b, balanced [3, 1]
    (["--mesh", "pp=2", "--pp-schedule", "gpipe", "--pp-layout", "1,3"], 2),  # uneven layout
    (["--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "2"], 2),
    (["--mesh", "pp=2", "--pp-schedule", "zbv", "--pp-virtual-stages", "2"], 2),  # zero bubble, V shape
    (["--mesh", "pp=2", "--pp-schedule", "zb", "--pp-virtual-stages", "2"], 2),
    (["--mesh", "pp=2,tp=2", "--sequence-parallel"], 4),
    (["--mesh", "dp=2,pp=2"], 4),
    (["--mesh", "cp=2,pp=2", "--cp-comm", "ring"], 4),
    (["--mesh", "pp=2", "--recompute-layers", "1"], 2),  # full recompute of the first block of each stage
]


@pytest.fixture(scope="module")
def single_run_16(tmp_path_factory):
    # Four micro-batches per data-parallel rank at dp=2 need a global batch of 16.
    return train_scalars(tmp_path_factory.mktemp("single16"), ["--global-batch", "16"])


@pytest.mark.slow
@pytest.mark.parametrize("mesh,nproc", CASES, ids=[" ".join(m) for m, _ in CASES])
def test_pipeline_matches_one_process(tmp_path, single_run_16, mesh, nproc):
    parallel = train_scalars(tmp_path, [*mesh, "--global-batch", "16"], nproc=nproc)
    for step, (a, e) in enumerate(zip(parallel["train/loss"], single_run_16["train/loss"]), 1):
        assert abs(a - e) <= LOSS_RTOL * abs(e), f"loss at step {step} on {mesh}: {a} vs one process {e}"
    for step, (a, e) in enumerate(zip(parallel["train/grad_norm"], single_run_16["train/grad_norm"]), 1):
        assert abs(a - e) <= LOSS_RTOL * abs(e), f"grad norm at step {step} on {mesh}: {a} vs {e}"
    assert len(parallel["train/loss"]) == 10
