"""Qwen3, Qwen3-MoE, gpt-oss and Llama 4 on every parallel dimension: the loss and the gradient
norm of each tiny preset on a mesh against one process of the same seed (CPU, gloo, fp32, 4 steps,
relative difference <= 1e-4 at every step), one multi-process run per case.

The cases are the dimensions each family's own parts meet: qk-norm's replicated weights under tp,
head_dim wider than dim / heads under a2a; windowed layers and attention sinks under tp and each
--cp-comm; chunked and NoPE layers under the ring (chunks that cross the context-parallel blocks,
the NoPE temperature at each rank's global positions) and split over pipeline stages with dense
and MoE blocks; biased experts and input-scaled routing under both --ep-dispatch values; and pairs
of them, and one-line refusals of what a dim cannot do for a family. The models are sharpened
(weights 2.5 times the preset's init std; Llama 4's temperature five times its published scale,
changing every 8 positions) and train at the full learning rate from the first step, so that a
mask, a sink, a bias or a position wrong on one rank moves the loss or the gradient norm by several
times the tolerance within the 4 steps; much sharper, and fp32 rounding alone grows past it."""

from __future__ import annotations

import pytest

from tests.launch import train_scalars


RTOL = 1e-4


STEPS = 4


SHARPEN = {
    "tiny-qwen3": "init_std=0.05",
    "tiny-qwen3-moe": "init_std=0.05",
    "tiny-gpt-oss": "init_std=0.05",
    # Chunks of 24 positions cross the 16-token blocks of cp=2 at seq 64.
    "tiny-llama4": "init_std=0.05,attn_scale=0.5,floor_scale=8,attention_chunk=24",
}


SP = "--sequence-parallel"


CASES = [
    # (model, mesh and its options, processes)
    ("tiny-qwen3", ["--mesh", "pp=2"], 2),
    ("tiny-qwen3", ["--mesh", "tp=2,cp=2", SP, "--cp-comm", "allgather"], 4),
    ("tiny-qwen3-moe", ["--mesh", "dp=2,pp=2,ep=2", "--ep-dispatch", "alltoall"], 4),
    ("tiny-qwen3-moe", ["--mesh", "cp=2,ep=2", "--cp-comm", "ring", "--ep-dispatch", "allgather"], 2),
    ("tiny-gpt-oss", ["--mesh", "tp=2,cp=2", SP, "--cp-comm", "ring"], 4),
    ("tiny-gpt-oss", ["--mesh", "cp=2,ep=2", "--cp-comm", "allgather", "--ep-dispatch", "alltoall"], 2),
    ("tiny-gpt-oss", ["--mesh", "cp=2,ep=2", "--cp-comm", "a2a", "--ep-dispatch", "allgather"], 2),
    ("tiny-gpt-oss", ["--mesh", "dp=2,ep=2,tp=2", SP, "--ep-dispatch", "alltoall"], 4),
    ("tiny-gpt-oss", ["--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "2"], 2),
    ("tiny-llama4", ["--mesh", "tp=2,cp=2", SP, "--cp-comm", "ring"], 4),
    ("tiny-llama4", ["--mesh", "pp=2,cp=2,ep=2", "--cp-comm", "a2a", "--ep-dispatch", "allgather"], 4),
    ("tiny-llama4", ["--mesh", "cp=2,ep=2", "--cp-comm", "allgather", "--ep-dispatch", "alltoall"], 2),
]


def _args(model: str) -> list[str]:
    # Full learning rate from the first step: the zero-initialised biases move by about lr a step.
    return ["--model", model, "--model-overrides", SHARPEN[model], "--global-batch", "16", "--steps", str(STEPS),
            "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """model -> the scalars of its one-process run (each run once per module)."""
    runs: dict[str, dict[str, list[float]]] = {}

    def run(model: str) -> dict[str, list[float]]:
        if model not in runs:
            runs[model] = train_scalars(tmp_path_factory.mktemp(model), _args(model))
        return runs[model]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,nproc", CASES, ids=[f"{m} {' '.join(a)}" for m, a, _ in CASES])
def test_family_matches_one_process(tmp_path, one_process, model, mesh, nproc):
    expected = one_process(model)
    parallel = train_scalars(tmp_path, [*_args(model), *mesh], nproc=nproc)
    for tag in ("train/loss", "train/grad_norm"):
        assert len(parallel[tag]) == STEPS, tag
        for step, (a, e) in enumerate(zip(parallel[tag], expected[tag]), 1):
            assert abs(a - e) <= RTOL * abs(e), f"{tag} at step {step} of {model} on {mesh}: {a} vs one process {e}"
