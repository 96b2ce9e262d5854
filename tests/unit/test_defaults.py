"""The options a run chooses where its user left them unset (dtrain/layout/defaults.py, inside
`resolve`): the largest micro-batch that the memory model fits, blocks kept gathered where that
fits too, a flag given always kept, each choice recorded in the layout with its reason, and nothing
chosen differently without a GPU to size for (CPU runs keep the defaults they always had)."""

from __future__ import annotations

import attrs
import pytest

from dtrain.config import load_config
from dtrain.layout import Machine, defaults, with_choices
from dtrain.planner import advice, memory
from dtrain.run import main
from tests.layouts import resolved


LLAMA_1B = ["--model", "llama-1b", "--seq-len", "4096", "--compile"]


def _gpu(memory_gb: float) -> Machine:
    return attrs.evolve(Machine.gpu_profile("h200"), gpu_memory_gb=memory_gb)


def _predicted(layout) -> float:
    return memory.predict_peak(layout)[0].total / 1e9


def _chosen(layout, option: str):
    return next(choice for choice in layout.chosen if choice.option == option)


def test_the_largest_micro_batch_the_memory_model_fits_with_its_reason():
    # A GPU large enough for every candidate: the token cap decides (8 x 4096 tokens).
    layout = resolved(LLAMA_1B, 1, _gpu(1000.0))
    assert layout.config.data.micro_batch == defaults.MAX_MICRO_BATCH_TOKENS // 4096 == 8
    assert layout.config.data.global_batch == 8 and layout.num_microbatches == 1
    # A GPU between two candidates' predicted peaks takes the smaller one.
    at_4, at_8 = (_predicted(resolved([*LLAMA_1B, "--micro-batch", str(m)], 1, _gpu(1000.0))) for m in (4, 8))
    assert at_4 < at_8
    memory_gb = (at_4 + at_8) / 2 / defaults.MEMORY_SHARE
    layout = resolved(LLAMA_1B, 1, _gpu(memory_gb))
    assert layout.config.data.micro_batch == 4 and layout.config.data.global_batch == 4
    assert _chosen(layout, "micro_batch").line().startswith(
        f"--micro-batch 4: the largest that fits {memory_gb:g} GB by the memory model ({at_4:.1f} GB predicted")
    # --gpu-memory-gb sizes for a GPU the machine does not have.
    assert resolved([*LLAMA_1B, "--gpu-memory-gb", f"{memory_gb}"]).config.data.micro_batch == 4


def test_the_micro_batch_divides_a_given_global_batch_and_a_given_one_is_kept():
    layout = resolved([*LLAMA_1B, "--global-batch", "12"], 1, _gpu(1000.0))
    assert layout.config.data.micro_batch == 4 and layout.num_microbatches == 3
    assert "dividing --global-batch 12 over the data-parallel ranks" in _chosen(layout, "micro_batch").reason
    # Over two data-parallel ranks, 12 is 6 each: of the powers of two, 1 and 2 divide it.
    two = resolved([*LLAMA_1B, "--global-batch", "12", "--mesh", "dp=2"], 2, _gpu(1000.0))
    assert two.config.data.micro_batch == 2 and two.num_microbatches == 3
    given = resolved([*LLAMA_1B, "--micro-batch", "3"], 1, _gpu(1000.0))
    assert given.config.data.micro_batch == 3 and all(c.option != "micro_batch" for c in given.chosen)


def test_a_pipeline_without_global_batch_keeps_its_micro_batches_per_step(caplog):
    """The default global batch follows the micro-batch chosen: 2 x pp micro-batches per step."""
    with caplog.at_level("INFO", logger="dtrain"):
        layout = resolved(["--model", "tiny", "--mesh", "pp=2", "--seq-len", "1024"], 2, _gpu(80.0))
    m = layout.config.data.micro_batch
    assert m == defaults.MAX_MICRO_BATCH_TOKENS // 1024 and layout.num_microbatches == 4
    assert layout.config.data.global_batch == 4 * m
    assert f"4 micro-batches of {m} per step" in caplog.text


def test_none_fits_takes_the_smallest_and_says_so():
    layout = resolved(LLAMA_1B, 1, _gpu(10.0))
    assert layout.config.data.micro_batch == 1
    assert "none fits 10 GB by the memory model; 1 predicts" in _chosen(layout, "micro_batch").reason


def test_without_a_gpu_to_size_for_the_defaults_are_as_before():
    layout = resolved(["--model", "tiny", "--mesh", "dp=2"], 2)
    assert layout.config.data.micro_batch == defaults.FALLBACK_MICRO_BATCH == 4
    assert layout.config.data.global_batch == 2 * defaults.FALLBACK_MICRO_BATCH
    assert layout.config.parallel.fsdp_reshard_after_forward == "default"
    assert [c.option for c in layout.chosen] == ["micro_batch", "fsdp_reshard_after_forward"]
    assert "no GPU memory to size it for" in layout.chosen[0].reason
    assert "every block but the last is freed" in layout.chosen[1].reason
    one = resolved(["--model", "tiny"])
    assert "one FSDP shard" in _chosen(one, "fsdp_reshard_after_forward").reason
    # A variant of another micro-batch is no longer the choice that was recorded.
    assert [c.option for c in with_choices(layout, micro_batch=2).chosen] == ["fsdp_reshard_after_forward"]


def test_blocks_stay_gathered_where_the_memory_model_fits_them():
    base = ["--model", "llama3-8b", "--seq-len", "8192", "--mesh", "dp=2", "--micro-batch", "1", "--compile"]
    default = _predicted(resolved([*base, "--fsdp-reshard-after-forward", "default"], 2, Machine.gpu_profile("h200")))
    never = _predicted(resolved([*base, "--fsdp-reshard-after-forward", "never"], 2, Machine.gpu_profile("h200")))
    assert never > default
    roomy = resolved(base, 2, _gpu(never / defaults.MEMORY_SHARE + 1))
    assert roomy.config.parallel.fsdp_reshard_after_forward == "never" and not roomy.parallel.fsdp.resharded
    assert roomy.chosen[-1].line().startswith("--fsdp-reshard-after-forward never: every block stays gathered")
    tight = resolved(base, 2, _gpu((default + never) / 2 / defaults.MEMORY_SHARE))
    assert tight.config.parallel.fsdp_reshard_after_forward == "default" and tight.parallel.fsdp.resharded
    assert "would take" in tight.chosen[-1].reason
    # A setting given is kept and not recorded; zero1 runs its own.
    for flags in (["--fsdp-reshard-after-forward", "always"], ["--dp-mode", "zero1"]):
        given = resolved([*base, *flags], 2, _gpu(1000.0))
        assert given.config.parallel.fsdp_reshard_after_forward == (flags[1] if flags[0].endswith("forward")
                                                                    else "default")
        assert given.chosen == ()


@pytest.mark.parametrize("memory_gb", [141.0, 80.0])
def test_the_targets_shapes_choose_within_the_memory_share(memory_gb):
    """What the one-GPU benchmark shapes choose: every choice is predicted to fit."""
    for argv in (LLAMA_1B, ["--model", "llama3.2-3b", "--seq-len", "8192", "--compile"],
                 ["--model", "llama3-8b", "--model-overrides", "num_layers=8", "--seq-len", "4096", "--compile"]):
        layout = resolved(argv, 1, _gpu(memory_gb))
        assert _predicted(layout) <= defaults.MEMORY_SHARE * memory_gb or layout.config.data.micro_batch == 1, argv


def test_print_plan_and_its_json_show_each_choice(capsys):
    args = ["--model", "tiny", "--seq-len", "64", "--gpu-memory-gb", "80", "--print-plan"]
    layout = resolved(args)
    assert _chosen(layout, "micro_batch").reason.startswith("the largest that fits 80 GB")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert all(choice.line() in out for choice in layout.chosen)
    assert layout.to_dict()["chosen"][0] == {"option": "micro_batch", "value": layout.config.data.micro_batch,
                                             "reason": layout.chosen[0].reason}


def test_mesh_auto_keeps_the_planners_resharding(monkeypatch):
    """The planner scored its layout at the resharding it chose: --mesh auto does not choose again."""
    base = ["--model", "llama3-8b", "--seq-len", "8192", "--micro-batch", "1", "--compile", "--gpu-memory-gb", "1000"]
    planners = load_config([*base, "--mesh", "dp=2"])
    monkeypatch.setattr(advice, "choose", lambda config, world_size: planners)
    layout = advice.resolve_run(load_config([*base, "--mesh", "auto"]), 2, Machine.gpu_profile("h200"))
    assert layout.config.parallel.fsdp_reshard_after_forward == "default" and layout.chosen == ()
    # The same layout given by its user keeps every block gathered on this GPU.
    given = resolved([*base, "--mesh", "dp=2"], 2, Machine.gpu_profile("h200"))
    assert given.config.parallel.fsdp_reshard_after_forward == "never"
