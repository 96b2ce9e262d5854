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

from dtrain.run import main
from tests.launch import TINY_ARGS


@pytest.mark.parametrize("model,extra,message", [
    ("tiny-gpt-oss", ["--precision", "bf16", "--fp8", "delayed", "--fp8-backend", "te", "--fp8-experts"],
     "this model's experts have biases or gpt-oss's clamped unit; use --fp8-backend torchao"),
    ("tiny-llama4", ["--model-overrides", "top_k=2", "--mesh", "dp=2,ep=2", "--ep-dispatch", "allgather"],
     "each of its top_k=2 experts sees it scaled by its own weight; use --ep-dispatch alltoall"),
    ("tiny-gpt-oss", ["--mesh", "cp=4", "--cp-comm", "a2a", "--seq-len", "64"],
     "--cp-comm a2a splits heads over cp=4, but each tp rank has 4 query and 2 KV heads"),
])
def test_what_a_dim_cannot_do_for_a_family_is_one_line(model, extra, message, capsys):
    assert main([*TINY_ARGS, "--model", model, *extra, "--print-plan"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
