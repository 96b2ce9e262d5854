"""Context parallelism through the CLI: loss parity against one process for each --cp-comm and
combined with tensor, sequence and data parallelism (CPU, gloo, fp32, 10 steps, relative loss
difference <= 1e-4 at every step)."""

import pytest

from tests.launch import train_scalars


LOSS_RTOL = 1e-4


CASES = [
    (["--mesh", "cp=2", "--cp-comm", "allgather"], 2),
    (["--mesh", "cp=2", "--cp-comm", "ring"], 2),
    (["--mesh", "cp=2", "--cp-comm", "a2a"], 2),
    (["--mesh", "cp=2,tp=2", "--sequence-parallel", "--cp-comm", "ring"], 4),
    (["--mesh", "dp=2,cp=2", "--cp-comm", "allgather"], 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,nproc", CASES, ids=[" ".join(m) for m, _ in CASES])
def test_context_parallel_matches_one_process(tmp_path, single_run, mesh, nproc):
    parallel = train_scalars(tmp_path, mesh, nproc=nproc)
    for tag in ("train/loss", "train/grad_norm"):
        for step, (a, e) in enumerate(zip(parallel[tag], single_run[tag]), 1):
            assert abs(a - e) <= LOSS_RTOL * abs(e), f"{tag} at step {step} on {mesh}: {a} vs one process {e}"
        assert len(parallel[tag]) == 10
