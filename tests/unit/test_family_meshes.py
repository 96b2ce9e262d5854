"""What a parallel dimension cannot do for one of today's families (Qwen3, Qwen3-MoE, gpt-oss,
Llama 4) is refused in one line naming the family and the dimension, before any work; the loss
parity of each family on each mesh runs in tests/integration/test_family_meshes.py."""

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
