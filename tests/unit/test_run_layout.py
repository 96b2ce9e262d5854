"""A run is resolved once (dtrain.layout.resolve): its decisions as one value, the same value
whether the planner derives a variant or a run resolves it, every check made once per run, and
`--print-plan --json` printing it. One process, no subprocess."""

from __future__ import annotations

import json

import attrs
import pytest

from dtrain.config import load_config
from dtrain.layout import Machine, checks, resolve, with_choices
from dtrain.planner.candidates import Fixed, Target
from dtrain.planner.search import search
from dtrain.run import main
from models.errors import UserError
from tests.launch import TINY_ARGS
from tests.layouts import resolved


H200 = Machine.gpu_profile("h200")


def test_a_layout_holds_every_roles_dims_and_every_decision():
    layout = resolved(["--model", "tiny-moe", "--mesh", "pp=2,dp_replicate=2,dp=2,cp=2,tp=2,ep=2", "--seq-len", "64",
                       "--micro-batch", "1", "--global-batch", "8", "--sequence-parallel", "--recompute-layers", "1",
                       "--pp-layout", "3,1"], 32)
    mesh = layout.mesh
    assert mesh.loss_dims == ("dp_shard", "dp_replicate", "cp", "pp")
    assert mesh.fsdp_dims == ("dp_replicate", "dp_shard_cp") and mesh.expert_fsdp_dims == ("dp_replicate", "edp")
    assert mesh.router_stats_dims == ("dp_shard", "dp_replicate", "cp", "tp")
    assert layout.pipeline.blocks_per_stage == (3, 1) and layout.num_microbatches == 2
    assert layout.pipeline.stage_ids(1) == [1]
    assert layout.tokens_per_micro_batch == 32 and layout.loss_scale == 4 * 2 / (8 * 64)
    par = layout.parallel
    assert par.plan.sequence_parallel and par.tp_overlap == "chunked"  # the CPU's choice
    assert par.ep_dispatch == "allgather" and par.cp_comm == "allgather"
    assert par.full_recompute == {"blocks.0", "blocks.3"}
    assert [par.recompute_of(f"blocks.{i}") for i in range(4)] == ["full", "none", "none", "full"]
    # Under pipelining every unit keeps its parameters gathered and reduces once per step.
    assert par.fsdp.resharded == frozenset() and par.fsdp.reduce_once


def test_the_machine_decides_what_depends_on_it():
    args = ["--model", "tiny", "--mesh", "tp=2", "--sequence-parallel", "--pp-schedule", "1f1b"]
    assert resolved(args, 2).parallel.tp_overlap == "chunked"
    assert resolved(args, 2, H200).parallel.tp_overlap is None  # the fused ops measured slower on CUDA
    fp8 = ["--model", "tiny", "--mesh", "dp=2", "--fp8", "tensorwise", "--precision", "bf16"]
    assert not resolved(fp8, 2).parallel.fp8.all_gather and resolved(fp8, 2).parallel.fp8.emulated
    assert resolved(fp8, 2, H200).parallel.fp8.all_gather and not resolved(fp8, 2, H200).parallel.fp8.emulated
    assert Machine.gpu_profile("a100-80gb").fp8_matmuls is False
    zb = ["--model", "tiny", "--mesh", "pp=2", "--pp-schedule", "zb", "--pp-virtual-stages", "2"]
    assert resolved(zb, 2).pipeline.schedule == "zb"
    with pytest.raises(UserError, match="does not finish a step over NCCL"):
        resolved(zb, 2, H200)


@pytest.mark.parametrize("choices", [
    dict(micro_batch=2),
    dict(recompute="selective", recompute_layers=1),
    dict(recompute="full"),
    dict(dp_mode="zero1"),
    dict(fsdp_reshard_after_forward="never", cpu_offload=True),
    dict(fsdp_reshard_after_forward="always", fsdp_reduce_once=True),
])
def test_a_variant_is_what_resolving_its_options_gives(choices):
    """The planner's variants of a mesh (`with_choices`) are the layouts a run of them resolves."""
    args = ["--model", "tiny-mla", "--mesh", "dp=4", "--seq-len", "64", "--micro-batch", "1", "--global-batch", "8"]
    base = resolved(args, 4)
    flags = [f"--{name.replace('_', '-')}" + ("" if value is True else f"={value}") for name, value in choices.items()]
    assert with_choices(base, **choices) == resolved([*args, *flags], 4)


def test_a_variant_a_run_would_refuse_is_refused():
    base = resolved(["--model", "tiny", "--mesh", "dp=2", "--global-batch", "8", "--micro-batch", "1"], 2)
    with pytest.raises(UserError, match="not divisible by --micro-batch 8"):
        with_choices(base, micro_batch=8)
    with pytest.raises(UserError, match="zero1 .* --cpu-offload"):
        with_choices(base, dp_mode="zero1", cpu_offload=True)


def test_the_planner_never_proposes_what_a_run_refuses():
    # llama3-8b's fp32 state does not fit two GPUs of 40 GB: only CPU offload does...
    target = Target(model="llama3-8b", gpus=2, seq_len=4096, global_batch=2, gpu_memory_gb=40)
    assert any(c.config.parallel.cpu_offload for c in search(target))
    # ... which a run refuses beside torchao's float8 all-gather (it needs the weights on the GPU).
    with_fp8 = search(attrs.evolve(target, fp8="tensorwise"))
    assert [c.command for c in with_fp8 if c.config.parallel.cpu_offload] == []
    # 8 experts cannot be split over 16 ranks: the given mesh is refused as a run refuses it.
    with pytest.raises(UserError, match="not divisible by ep=16"):
        search(Target(model="mixtral-8x7b", gpus=16, seq_len=4096, global_batch=16, fixed=Fixed(mesh="dp=16,ep=16")))


def test_every_check_runs_once_per_run(tmp_path, monkeypatch):
    calls = []
    for name in ("check_options", "check_split", "check_kernels", "check_choices", "check_inputs"):
        original = getattr(checks, name)
        monkeypatch.setattr(checks, name, lambda *args, _f=original, _n=name: calls.append(_n) or _f(*args))
    assert main([*TINY_ARGS, "--steps", "1", "--run-dir", str(tmp_path), "--step-timeout", "0"]) == 0
    assert sorted(calls) == sorted(["check_options", "check_split", "check_kernels", "check_choices", "check_inputs"])


def test_print_plan_json_is_the_layouts_dict(capsys):
    args = ["--model", "tiny", "--mesh", "pp=2,tp=2", "--sequence-parallel", "--global-batch", "8", "--world-size", "4",
            "--print-plan"]
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    layout = resolved(args, 4, Machine.detect())
    assert printed == json.loads(json.dumps(layout.to_dict()))
    assert printed["mesh"]["roles"] == {"loss": ["pp"], "fsdp": ["dp_shard"], "tp": ["tp"], "pp": ["pp"]}
    assert printed["pipeline"]["blocks_per_stage"] == list(layout.pipeline.blocks_per_stage)
    assert main(["--model", "tiny", "--json"]) == 2
    assert "--json prints the layout of --print-plan" in capsys.readouterr().err


def test_a_toml_value_outside_a_flags_choices_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nattention_kernel = "xformers"\n')
    with pytest.raises(UserError, match="--attention-kernel 'xformers': choose one of auto, flex, varlen, dense"):
        resolve(load_config(["--config", str(path)]), 1, Machine())


def test_a_layout_is_a_value():
    layout = resolved(["--model", "tiny"])
    assert layout == resolved(["--model", "tiny"])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.parallel.recompute = "full"
