"""The DeepSeek family's settings checked before a run: bad MLA, routing or MTP options are one-line
errors, and --print-plan keeps the latent projections whole while it splits the heads; its loss
parity on every mesh runs in tests/integration/test_deepseek_training.py."""

import pytest

from dtrain.run import main
from tests.launch import TINY_ARGS


MLA = ["--model", "tiny-mla", "--steps", "6"]


@pytest.mark.parametrize("extra,message", [
    (["--mesh", "tp=3"], "num_heads=4, not divisible by tp=3"),
    (["--model-overrides", "num_expert_groups=3"], "num_expert_groups=3 must be >= 1 and divide num_experts=8"),
    (["--model-overrides", "topk_groups=1,top_k=3"], "top_k=3 experts do not fit in topk_groups=1 groups of 2"),
    (["--model-overrides", "qk_rope_head_dim=7"], "qk_rope_head_dim=7 must be even"),
    (["--model-overrides", "num_kv_heads=2"], "num_kv_heads=2 must equal num_heads=4"),
    (["--model-overrides", "mtp_depth=-1"], "mtp_depth=-1 must be >= 0"),
    (["--model-overrides", "rope_scaling=yarn"], "'yarn' is not a valid YarnScaling | None"),
])
def test_bad_deepseek_settings_are_one_line_errors(extra, message, capsys):
    assert main([*TINY_ARGS, *MLA, *extra, "--print-plan"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_print_plan_keeps_the_latent_projections_whole_and_splits_the_heads(capsys):
    assert main(["--model", "tiny-mla", "--mesh", "tp=2", "--print-plan"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[3:]}
    assert rows["blocks.0.attn.wkv_a"] == ["latent,embed", "tp:R", "40x64", "40x64"]
    assert rows["blocks.0.attn.wkv_b"] == ["heads,latent", "tp:S(0)", "128x32", "64x32"]
    assert rows["mtp.0.eh_proj"] == ["embed,embed", "tp:R", "64x128", "64x128"]
    assert rows["mtp.embedding"] == ["tied", "to", "embed.weight"]
