"""The planner and the dry run on today's families: attention time by layer kind (windowed and
chunked layers attend fewer keys), dense and MoE blocks apart, the largest Qwen3-MoE and gpt-oss
planned on 256 GPUs, and the dry run building them at that size (one pipeline rank's program)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dtrain.inspect.dry_run import dry_run
from dtrain.layout import Machine
from dtrain.planner import kernels
from dtrain.planner.hardware import H200
from dtrain.planner.workload import workload
from tests.layouts import resolved


GB = 1e9


def _work(model: str, seq_len: int, *args: str):
    return workload(resolved(["--model", model, "--seq-len", str(seq_len), "--micro-batch", "1", *args], 1,
                             Machine.gpu_profile("h200")))


def test_windowed_and_chunked_layers_take_the_attention_time_of_their_keys():
    # gpt-oss: windows of 128 on even layers; the kernel skips the blocks outside the window.
    work = _work("gpt-oss-20b", 8192, "--model-overrides", "num_layers=2")
    window, full = (kernels.attention_seconds(work, block, H200) for block in (0, 1))
    assert work.attention_kinds == ("window", "full")
    # Fewer keys, though at a lower rate (short key ranges run slower): 128 keys against 4096 on average.
    assert window < full / 1.5
    # The whole model's attention: the two kinds, each counted for its own blocks.
    [stage] = work.stages
    assert sorted(kind for kind in (work.attention_kinds[b] for b, _, _ in work.block_mix(stage))) == ["full", "window"]
    # Llama 4: chunks of 8192 on three layers of four, NoPE layers attend to the whole sequence.
    work = _work("llama4-scout-17b-16e", 32768, "--model-overrides", "num_layers=4")
    chunk, nope = (kernels.attention_seconds(work, block, H200) for block in (0, 3))
    assert work.attention_kinds == ("chunk", "chunk", "chunk", "nope")
    # A quarter of the keys, at a somewhat lower rate over 8192-key ranges.
    keys_share = kernels.mean_keys(32768, None, 0, 8192) / kernels.mean_keys(32768, None)
    assert keys_share == pytest.approx(0.25, rel=1e-3)
    assert nope * keys_share < chunk < nope * 2 * keys_share
    # Keys per query within chunks: (C + 1) / 2 where the sequence is whole chunks.
    assert kernels.mean_keys(32768, None, 0, 8192) == (8192 + 1) / 2
    assert kernels.mean_keys(4096, None, 0, 8192) == kernels.mean_keys(4096, None)


def test_dense_and_moe_blocks_are_costed_apart():
    """Qwen3-MoE with a dense first block (mlp_only_layers): the dense block's GEMMs are its
    SwiGLU's, the MoE block's its top-k experts' (at the grouped GEMM's rate) and its router's."""
    work = _work("qwen3-30b-a3b", 4096, "--model-overrides", "num_layers=2,dense_layers=[0]")
    assert work.block_kinds == ("dense", "moe")
    axes = {kind: {axes for _, _, axes in work.weights_by_kind[kind]} for kind in ("dense", "moe")}
    assert ("mlp", "embed") in axes["dense"] and ("expert", "expert_mlp", "embed") in axes["moe"]
    assert ("mlp", "embed") not in axes["moe"]
    dense, moe = (kernels.gemm_seconds(work, block, H200)[0] for block in (0, 1))
    assert dense != moe


DRY_RUNS = {
    # The planner's layouts of these models on 256 H200 (seq 4096, global batch 1024).
    "qwen3-235b-a22b": ["--mesh", "pp=8,dp_replicate=4,dp_shard=8,ep=4", "--micro-batch", "4",
                        "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "6", "--recompute-layers", "2"],
    "gpt-oss-120b": ["--mesh", "pp=4,dp_shard=64,ep=8", "--micro-batch", "4", "--pp-schedule", "interleaved-1f1b",
                     "--pp-virtual-stages", "8"],
}


@pytest.mark.parametrize("model,mesh", [("tiny-gpt-oss", "dp=4,ep=2,tp=2"), ("tiny-llama4", "pp=2,cp=2,dp=2,ep=2")])
def test_the_dry_run_runs_windowed_chunked_and_routed_layers(model, mesh, capsys):
    """Their masks are left out (causal attention keeps what the masked kernels keep), and the
    experts exchange an even share of the rows."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    reports = dry_run(resolved(["--dry-run", "--world-size", "8", "--model", model, "--mesh", mesh,
                                "--seq-len", "64", "--sequence-parallel"], 8))
    assert reports and all(report.param_bytes > 0 for _, report in reports)
    assert all(any(dim == "ep" and tally.bytes > 8 for (dim, _), tally in report.collectives.items())
               for _, report in reports)
    assert "every layer attends causally" in capsys.readouterr().out
