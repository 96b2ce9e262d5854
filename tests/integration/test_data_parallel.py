"""Loss parity of FSDP and HSDP against one process (CPU, gloo, fp32), with and without CPU
offload, and on a GPU that offloaded shards stay in host memory."""

import re

import pytest

from tests.launch import TINY_ARGS, run_cli, train_scalars


# fp32 on CPU: the only differences are the order of float reductions across ranks.
LOSS_RTOL = 1e-4


GRAD_NORM_RTOL = 1e-4


def _assert_close(actual, expected, rtol, what):
    assert len(actual) == len(expected) == 10, (what, len(actual), len(expected))
    for step, (a, e) in enumerate(zip(actual, expected), 1):
        assert abs(a - e) <= rtol * abs(e), f"{what} at step {step}: {a} vs one process {e}"


@pytest.mark.slow
@pytest.mark.parametrize("mesh,nproc,extra", [
    ("dp=2", 2, []), ("dp_replicate=2,dp_shard=2", 4, []), ("dp=2", 2, ["--fsdp-reshard-after-forward", "never"]),
    ("dp_replicate=2", 2, []),  # one shard: each unit all-reduces once per step, after both micro-batches
    ("dp=2", 2, ["--fsdp-reduce-once"]),  # two micro-batches per rank: one reduce-scatter after both
    # ZeRO-1: parameters whole through the step, gradients reduce-scattered once, AdamW on shards.
    ("dp=2", 2, ["--dp-mode", "zero1"]), ("dp_replicate=2,dp_shard=2", 4, ["--dp-mode", "zero1"]),
    # Shards in host memory, AdamW's fused kernel on the CPU (foreach in the reference).
    ("dp=2", 2, ["--cpu-offload"]),
])
def test_data_parallel_matches_one_process(single_run, tmp_path, mesh, nproc, extra):
    parallel = train_scalars(tmp_path, ["--mesh", mesh, *extra], nproc=nproc)
    _assert_close(parallel["train/loss"], single_run["train/loss"], LOSS_RTOL, f"loss on {mesh}")
    # The norm is logged before clipping, so this checks the global reduction over the shards.
    _assert_close(parallel["train/grad_norm"], single_run["train/grad_norm"], GRAD_NORM_RTOL,
                  f"grad norm on {mesh}")


def test_loss_decreases_and_scalars_are_logged(single_run):
    for tag in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_sec_per_gpu", "mem/peak_gb"):
        assert len(single_run[tag]) == 10, tag
    # MFU is left out on the CPU rather than reported wrong.
    assert "perf/mfu" not in single_run
    losses = single_run["train/loss"]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(n > 0 for n in single_run["train/grad_norm"])


def _reductions_and_gathers(tmp_path, mesh: str, nproc: int, extra: list[str],
                            variants=(("each", []), ("once", ["--fsdp-reduce-once"]))) -> dict[str, tuple[int, int]]:
    """FSDP's gradient reductions and all-gathers in two steps, by default and with --fsdp-reduce-once
    (or the named flags of `variants`)."""
    counts = {}
    for name, flags in variants:
        args = [*TINY_ARGS, "--steps", "2", "--mesh", mesh, "--run-dir", str(tmp_path / name), *extra, *flags]
        result = run_cli(args, nproc=nproc, module="tests.workers.count_grad_reductions")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        line = re.findall(r"^GRAD_REDUCTIONS (\d+) ALL_GATHERS (\d+)$", result.stdout, re.M)[-1]
        counts[name] = tuple(map(int, line))
    return counts


@pytest.mark.slow
def test_reduce_once_reduces_gradients_once_per_step(tmp_path):
    """Two micro-batches per rank: with --fsdp-reduce-once FSDP reduces each group's gradients
    after the last one only, half as often as by default, and the second forward finds the
    parameters still gathered by the first backward."""
    counts = _reductions_and_gathers(tmp_path, "dp=2", 2, [])
    (reduce_each, gather_each), (reduce_once, gather_once) = counts["each"], counts["once"]
    assert reduce_once > 0 and reduce_each == 2 * reduce_once, counts
    # With --fsdp-reduce-once each group (reduced once per step) skips one gather per step: the
    # second forward's.
    assert gather_each - gather_once == reduce_once, counts


@pytest.mark.slow
def test_zero1_gathers_and_reduces_each_unit_once_per_step(tmp_path):
    """--dp-mode zero1 with two micro-batches per rank: every unit is all-gathered once per step
    (before its first forward) and reduce-scattered once (after its last backward), where FSDP by
    default gathers all but the last block again for each backward and reduces after each."""
    counts = _reductions_and_gathers(tmp_path, "dp=2", 2, [],
                                     variants=(("fsdp", []), ("zero1", ["--dp-mode", "zero1"])))
    (reduce_fsdp, gather_fsdp), (reduce_zero1, gather_zero1) = counts["fsdp"], counts["zero1"]
    assert reduce_zero1 == gather_zero1 > 0 and reduce_fsdp == 2 * reduce_zero1, counts
    assert gather_fsdp > 3 * gather_zero1, counts


@pytest.mark.slow
@pytest.mark.parametrize("mesh,nproc,extra", [
    ("", 1, []),  # four micro-batches in one process
    ("tp=2", 2, []),
    ("dp_replicate=2", 2, []),  # HSDP with one shard: the all-reduce once per step
    ("dp=2,ep=2", 2, ["--model", "tiny-moe"]),  # the experts have one shard each, the rest two
    # Offloaded shards live in host memory: whole gradients would take GPU memory, so not by default.
    ("", 1, ["--cpu-offload"]),
])
def test_units_with_one_shard_reduce_once_per_step_by_default(tmp_path, mesh, nproc, extra):
    """An FSDP unit with one shard reduces its gradients after the last micro-batch only, with or
    without --fsdp-reduce-once: there the whole gradients take no more memory than the shards."""
    counts = _reductions_and_gathers(tmp_path, mesh, nproc, extra)
    (reduce_each, _), (reduce_once, _) = counts["each"], counts["once"]
    if mesh == "dp=2,ep=2":
        # Without the default the sharded units would reduce twice as often (as on dp=2 above).
        assert reduce_once < reduce_each < 2 * reduce_once, counts
    elif "--cpu-offload" in extra:
        assert reduce_each == 4 * reduce_once > 0, counts  # after each of the four micro-batches
    else:
        assert reduce_each == reduce_once > 0, counts
