"""Packed documents through the CLI under context and pipeline parallelism: indexed data with
--document-mask, --reset-position-ids and a sliding window trains to the losses and gradient norms
of one process (CPU, gloo, fp32, 4 steps, relative difference <= 1e-4 at every step): the ring and
a2a (with selective recompute) --cp-comm and an interleaved pipeline. (The all-gather method differs
from them only inside attention, which tests/integration/test_context_parallel_attention.py checks.) (--compile with masks runs in
the GPU benchmarks: inductor's CPU compile is too slow for CI.)
The masks themselves are checked against one device in tests/integration/test_context_parallel_attention.py."""

import pytest
import torch

from models import masking
from tests.launch import train_scalars


LOSS_RTOL = 1e-4
DOCUMENTS = ["--document-mask", "--reset-position-ids", "--model-overrides", "sliding_window=24", "--steps", "4"]

CASES = [
    (["--mesh", "cp=2", "--cp-comm", "ring"], 2),
    (["--mesh", "cp=2", "--cp-comm", "a2a", "--recompute", "selective"], 2),
    (["--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "2"], 2),
]


@pytest.fixture(scope="module")
def single_documents_run(tmp_path_factory, indexed_corpus):
    return train_scalars(tmp_path_factory.mktemp("single_documents"), ["--data", indexed_corpus, *DOCUMENTS])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case also runs the one-process reference
@pytest.mark.parametrize("mesh,nproc", CASES, ids=[" ".join(m) for m, _ in CASES])
def test_documents_match_one_process(tmp_path, indexed_corpus, single_documents_run, mesh, nproc):
    parallel = train_scalars(tmp_path, ["--data", indexed_corpus, *DOCUMENTS, *mesh], nproc=nproc)
    for tag in ("train/loss", "train/grad_norm"):
        assert len(parallel[tag]) == 4
        for step, (a, e) in enumerate(zip(parallel[tag], single_documents_run[tag]), 1):
            assert abs(a - e) <= LOSS_RTOL * abs(e), f"{tag} at step {step} on {mesh}: {a} vs one process {e}"
    # The attention work is counted once per row whatever the mesh, and the documents make it less
    # than that of rows that are one document each (with the window of 24).
    keys = parallel["perf/attended_keys_per_token"]
    assert keys == pytest.approx(single_documents_run["perf/attended_keys_per_token"], rel=1e-6)
    one_document = masking.attended_pairs(masking.first_keys(torch.zeros(1, 64, dtype=torch.int64), 24)) / 64
    assert all(1 < k < one_document for k in keys), (keys, one_document)
