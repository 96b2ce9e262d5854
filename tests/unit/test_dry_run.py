"""The dry run: ranks grouped into roles from the mesh alone, the accounting of a fake-tensor run
(live bytes, collectives per mesh dim), a pipelined world of 64 fake ranks run in this process,
and the same one-line errors as a real run."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from dtrain import rank_model
from dtrain.inspect.accounting import Accounting
from dtrain.inspect.dry_run import dry_run
from dtrain.inspect.roles import find_roles
from dtrain.run import main
from models import families, spec
from models.errors import UserError
from parallel.mesh import build_meshes
from parallel.parallelize import materialize
from tests.layouts import resolved


def _roles(args: list[str], world_size: int):
    layout = resolved(args, world_size)
    counts = list(layout.pipeline.blocks_per_stage)
    return find_roles(layout.plan, layout.model_cfg, counts, schedule="1f1b", virtual=1,
                      seq_len=layout.config.data.seq_len), counts


def test_a_128_rank_llama3_70b_has_a_role_per_pipeline_rank_and_shares_programs():
    roles, counts = _roles(["--model", "llama3-70b", "--mesh", "tp=8,pp=8,cp=2"], 128)
    per_pp_rank = 128 // 8
    assert [role.ranks for role in roles] == [tuple(range(i * per_pp_rank, (i + 1) * per_pp_rank)) for i in range(8)]
    # Stages run the same program when they have the same layers: the first and last stages
    # have their own, the middle ones one per number of blocks.
    last = len(counts) - 1
    kinds = {(stage == 0, stage == last, counts[stage]) for stage in range(len(counts))}
    assert len({role.program for role in roles}) == len(kinds)


def test_an_uneven_shard_sets_the_last_rank_apart():
    # FSDP splits dim 0 of every parameter over dp=3: 64 rows go 22, 22, 20.
    roles, _ = _roles(["--model", "tiny", "--mesh", "dp=3"], 3)
    assert [role.ranks for role in roles] == [(0, 1), (2,)]
    roles, _ = _roles(["--model", "tiny", "--mesh", "dp=4"], 4)
    assert [role.ranks for role in roles] == [(0, 1, 2, 3)]


def test_accounting_counts_fsdp_gathers_reductions_and_live_shards(fake_world):
    # Parameters stay gathered between forward and backward: one all-gather (bf16) and one
    # reduce-scatter (fp32) of every parameter, once.
    args = ["--model", "tiny", "--mesh", "dp=2", "--fsdp-reshard-after-forward", "never"]
    layout = resolved(args, 2)
    model_cfg = layout.model_cfg
    layers = families.layers(model_cfg)
    numel = sum(math.prod(p.shape) for layer in layers for _, p in spec.flatten(layer.params))
    with fake_world(2):
        meshes = build_meshes(layout.mesh, "cpu")
        built = rank_model.build_model_parts(layout, meshes, device=torch.device("meta"))
        model = built.parts[0]
        with FakeTensorMode(allow_non_fake_inputs=True), Accounting({"dp_shard": meshes.group("dp_shard")}) as acct:
            materialize(model, torch.device("cpu"), seed=0)
            shards = sum(p.to_local().numel() * 4 for p in model.parameters())
            assert shards == numel * 4 // 2  # even splits: half of every fp32 parameter
            assert acct.live_bytes == shards
            tokens = torch.randint(0, model_cfg.vocab_size, (2, 64))
            aux = attrs.evolve(families.make_aux(model_cfg, torch.arange(64)), labels=tokens)
            with built.ctx.kernel_scope():
                model(tokens, aux).backward()
            del tokens, aux
            collectives = acct.take_collectives()
            # Sharded fp32 parameters and their sharded fp32 gradients; the gathered copies are gone.
            assert acct.live_bytes == 2 * shards
    units = len(layers)  # embedding, each block, head: one FSDP unit each
    assert collectives["dp_shard", "all-gather"].count == units
    assert collectives["dp_shard", "all-gather"].bytes == numel * 2
    assert collectives["dp_shard", "reduce-scatter"].count == units
    assert collectives["dp_shard", "reduce-scatter"].bytes == numel * 4
    assert set(collectives) == {("dp_shard", "all-gather"), ("dp_shard", "reduce-scatter")}


DRY_ARGS = ["--dry-run", "--world-size", "64", "--model", "tiny", "--mesh", "tp=2,pp=2,cp=2", "--seq-len", "64",
            "--micro-batch", "2"]


@pytest.fixture(scope="module")
def pipelined_dry_run():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    return dry_run(resolved(DRY_ARGS, 64))


def test_pipelined_dry_run_of_64_ranks(pipelined_dry_run):
    layout = resolved(DRY_ARGS, 64)
    config, mesh_spec, model_cfg, plan = layout.config, layout.mesh, layout.model_cfg, layout.plan
    m = layout.num_microbatches
    counts = list(layout.pipeline.blocks_per_stage)
    assert [role.ranks for role, _ in pipelined_dry_run] == [tuple(range(32)), tuple(range(32, 64))]
    layers = families.layers(model_cfg)
    for (role, report), stage in zip(pipelined_dry_run, (0, 1)):
        from parallel.pipeline import stage_layers

        params = [p for layer in stage_layers(layers, counts, stage) for _, p in spec.flatten(layer.params)]
        at = mesh_spec.coordinates(role.first_rank)
        assert report.param_bytes == sum(math.prod(plan.local_shape(p.shape, p.axes, at)) * 4 for p in params)
        # AdamW's two fp32 moments, and the fused kernel's fp32 step count per parameter.
        assert report.optimizer_bytes == 2 * report.param_bytes + 4 * len(params)
        assert report.grad_bytes == report.param_bytes
        # Each stage has one neighbour: per micro-batch one activation one way, its gradient back,
        # this rank's bf16 residual shard [micro-batch, seq / cp, dim].
        boundary = config.data.micro_batch * (config.data.seq_len // mesh_spec.cp) * model_cfg.dim * 2
        tally = report.collectives["pp", "send/recv"]
        assert (tally.count, tally.bytes) == (2 * m, 2 * m * boundary)
        # 1F1B: pipeline rank r holds min(pp - r, m) micro-batches at its fullest.
        fullest = max(sum(point.values()) for point in report.held[role.pp_rank])
        assert fullest == min(mesh_spec.pp - role.pp_rank, m)
        assert report.collectives["cp", "all-gather"].count > 0 and report.collectives["tp", "all-reduce"].count > 0


def test_the_step_measured_has_adamws_moments_in_memory_through_its_micro_batches():
    """As every step after the first: at the end of the forward the parameters, the optimizer
    state and the forward's activations are all live."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    [(_, report)] = dry_run(resolved(["--dry-run", "--world-size", "1", "--model", "tiny", "--seq-len", "64",
                                      "--micro-batch", "2"]))
    [stage] = report.stages
    end_of_forward = report.param_bytes + report.optimizer_bytes + stage.activation_bytes
    assert report.phase_peaks["micro-batches"] >= end_of_forward


def test_dry_run_rank_runs_that_rank_only(capsys):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    assert main(["--dry-run", "--world-size", "4", "--model", "tiny", "--model-overrides", "num_layers=2",
                 "--mesh", "dp=2,pp=2", "--seq-len", "32", "--dry-run-rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "ranks 3 | pp rank 1: stage 1 (block 1 + head) (run as rank 3" in out
    assert "ranks 2" not in out and "run as rank 2" not in out


BAD = [
    (["--mesh", "tp=3"], 3),  # heads not divisible
    (["--mesh", "pp=2", "--global-batch", "2", "--micro-batch", "1"], 4),  # too few micro-batches
    (["--mesh", "pp=2", "--pp-layout", "4,0"], 2),  # an empty stage
    (["--mesh", "tp=2", "--seq-len", "63", "--sequence-parallel", "--model", "tiny-moe"], 2),
]


@pytest.mark.parametrize("extra,world_size", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_bad_input_is_the_same_one_line_error_as_a_real_run(extra, world_size, capsys):
    args = ["--model", "tiny", *extra]
    with pytest.raises(UserError) as real:
        resolved(args, world_size)
    assert main(["--dry-run", "--world-size", str(world_size), *args]) == 2
    assert capsys.readouterr().err.strip() == f"dtrain: error: {real.value}"


@pytest.mark.parametrize("extra,message", [
    (["--dry-run-rank", "4"], "--dry-run-rank 4 is not a rank of a world of 4"),
])
def test_what_a_dry_run_cannot_do_is_one_line(extra, message, capsys):
    assert main(["--dry-run", "--world-size", "4", "--model", "tiny", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dtrain: error: ") and "\n" not in err and message in err, err
