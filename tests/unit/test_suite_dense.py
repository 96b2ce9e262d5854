"""The one-GPU dense benchmark group on the CPU, so that a GPU call is not the first to run it:
each setup's flags load, the suite hands every process of a call one call id and the results'
folder, and the group's kinds of run (the defaults with the baseline and a profile; FP8 with the
head and a global batch) run with the GPU shapes swapped for a tiny one, their rows carrying the
baseline and the ratio."""

from __future__ import annotations

from tools import bench, bench_suite, suite_dense
from tools.shapes import SHAPES


GPU_ONLY = ("--compile",)


def _on_cpu(bench_args: list[str]) -> list[str]:
    """A setup's tools.bench arguments at the tiny shape, a few steps of a global batch of 4 where it
    gives one, sized for 0.4 GB (a few samples); fp32 unless FP8."""
    args = list(bench_args)
    args[args.index("--shape") + 1] = "tiny-defaults"
    args[args.index("--steps") + 1], args[args.index("--warmup") + 1] = "3", "1"
    flags = [a for a in args[args.index("--") + 1:] if a not in GPU_ONLY]
    if "--global-batch" in flags:
        flags[flags.index("--global-batch") + 1] = "4"
    precision = [] if "--fp8" in flags else ["--precision", "fp32"]
    return [*args[:args.index("--") + 1], *flags, *precision, "--seq-len", "32", "--gpu-memory-gb", "0.4"]


def test_every_dense_setup_is_in_the_suite_with_a_known_shape():
    for group, members in suite_dense.GROUPS.items():
        assert bench_suite.GROUPS[group] == members and set(members) <= set(bench_suite.SUITE)
    for name, (_, args) in suite_dense.SETUPS.items():
        assert name in bench_suite.SUITE
        if "--shape" in args:
            assert args[args.index("--shape") + 1] in SHAPES, name
    assert bench_suite.selected(1, [], "dense-one-gpu") == suite_dense.GROUPS["dense-one-gpu"]


def test_compiler_settings_are_parsed_as_literals_of_known_keys():
    import pytest

    assert bench.inductor_settings(["cpp_wrapper=True", "combo_kernels=False"]) == {"cpp_wrapper": True,
                                                                                    "combo_kernels": False}
    for bad in ("no_such_setting=1", "cpp_wrapper", "cpp_wrapper=yes please"):
        with pytest.raises(ValueError, match="--inductor"):
            bench.inductor_settings([bad])


def test_the_baseline_refuses_what_a_plain_llama_does_not_run():
    from models.presets import get_model_config
    from tools.baseline import unsupported

    assert unsupported(get_model_config("llama-1b")) is None
    assert unsupported(get_model_config("tiny-qwen3")) == "qk_norm"
    assert unsupported(get_model_config("tiny-moe")) == "MoEConfig models"
    assert unsupported(get_model_config("tiny"), document_mask=True) == "--document-mask"
