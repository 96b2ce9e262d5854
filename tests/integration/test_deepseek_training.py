"""The DeepSeek family through the CLI: tiny-mla (MLA with query compression and YaRN, group-limited
sigmoid routing with the selection bias and its updates, shared experts, a dense first layer,
one MTP module) on every parallel dimension against one process (CPU, gloo, fp32, 6 steps,
relative difference <= 2e-4 at every step of the loss, the gradient norm and the MTP loss), on
packed documents with their masks, positions and a sliding window, which MLA and the MTP block
read per micro-batch (plain causal MLA on cp: tests/integration/test_context_parallel_attention.py).

pp=2 puts the MTP layer on the last stage with a copy of the embedding it shares; cp=2 gives each
rank the tokens ahead of its own chunks, taken from the whole sequences. A gradient norm that
matches at every step also checks that the embedding's two copies stay one parameter."""

import pytest

from tests.launch import train_scalars
from tests.unit.test_deepseek_training import MLA


RTOL = 2e-4


DOCUMENTS = ["--document-mask", "--reset-position-ids", "--model-overrides", "sliding_window=24"]


CASES = [
    (["--mesh", "dp=2,ep=2"], 2),
    (["--mesh", "tp=2", "--sequence-parallel"], 2),
    (["--mesh", "cp=2"], 2),
    (["--mesh", "pp=2"], 2),
]


@pytest.fixture(scope="module")
def single_mla(tmp_path_factory, indexed_corpus):
    return train_scalars(tmp_path_factory.mktemp("single-mla"), [*MLA, "--data", indexed_corpus, *DOCUMENTS])


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case also runs the one-process reference
@pytest.mark.parametrize("mesh,nproc", CASES, ids=[" ".join(m) for m, _ in CASES])
def test_tiny_mla_matches_one_process(tmp_path, indexed_corpus, single_mla, mesh, nproc):
    parallel = train_scalars(tmp_path, [*MLA, "--data", indexed_corpus, *DOCUMENTS, *mesh], nproc=nproc)
    for tag in ("train/loss", "train/grad_norm", "train/mtp_loss"):
        assert len(parallel[tag]) == 6, tag
        for step, (a, e) in enumerate(zip(parallel[tag], single_mla[tag]), 1):
            assert abs(a - e) <= RTOL * abs(e), f"{tag} at step {step} on {mesh}: {a} vs one process {e}"
    # The MTP module learns: its loss is logged apart and falls with the model's.
    assert single_mla["train/mtp_loss"][-1] < single_mla["train/mtp_loss"][0]
