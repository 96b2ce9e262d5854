"""Experts laid out apart from attention (`etp=1` in --mesh, Megatron's "parallel folding"):
attention split over tp, the experts over ep ranks that fold tp's ranks in (dp_shard x cp x tp,
tp innermost), each tp rank holding other experts. The mesh string, the expert mesh's groups and
each rank's place on it, the plan's layout, the gradients' scale, a 256-rank dry run, and what
the planner predicts of it. Loss parity on gloo against one process: tests/unit/test_moe_training.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dtrain import distributed
from dtrain.inspect.dry_run import dry_run
from dtrain.layout import Machine
from dtrain.planner import memory
from dtrain.planner.candidates import Target
from dtrain.planner.search import search
from dtrain.run import main
from models.errors import UserError
from parallel.mesh import MeshSpec, build_expert_mesh
from tests.layouts import resolved


def test_etp_1_folds_tp_into_the_ranks_ep_may_take():
    spec = MeshSpec.parse("dp=2,tp=4,ep=8,etp=1", 8)
    assert (spec.world_size, spec.expert_ranks, spec.edp, spec.experts_fold_tp) == (8, 8, 1, True)
    assert str(spec) == "dp_shard=2,tp=4,ep=8,etp=1"
    # Every token went through one expert rank: no tp sum of the expert gradients, scaled by tp / ep.
    beside = MeshSpec.parse("dp=4,tp=2,ep=2", 8)
    assert (spec.expert_grad_sum_dims, spec.expert_grad_scale) == ((), 4 / 8)
    assert (beside.expert_grad_sum_dims, beside.expert_grad_scale) == (("tp",), 1 / 2)
    assert "expert_grad_sum" not in spec.roles() and beside.roles()["expert_grad_sum"] == ["tp"]
    # Without etp, ep borrows from dp_shard x cp only, and says how to fold.
    with pytest.raises(UserError, match=r"ep=8 must divide dp_shard x cp = 2 x 1.*add etp=1 to fold tp's 4 ranks in"):
        MeshSpec.parse("dp=2,tp=4,ep=8", 8)
    with pytest.raises(UserError, match="ep=16 must divide dp_shard x cp x tp = 2 x 1 x 4"):
        MeshSpec.parse("dp=2,tp=4,ep=16,etp=1", 8)
    with pytest.raises(UserError, match="etp=4 in --mesh .*keeps every expert whole"):
        MeshSpec.parse("dp=2,tp=4,ep=2,etp=4", 8)
    # tp=1 folds nothing: the layout is the one without etp.
    assert MeshSpec.parse("dp=4,ep=2,etp=1", 4).edp == MeshSpec.parse("dp=4,ep=2", 4).edp == 2


@pytest.mark.parametrize("text", ["dp=2,tp=4,ep=4,etp=1", "dp=2,tp=4,ep=2,etp=1", "dp=2,tp=4,ep=8,etp=1",
                                  "dp=4,tp=2,ep=2"])
def test_each_rank_sits_on_the_expert_mesh_where_its_coordinates_say(text):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    spec = MeshSpec.parse(text, 8)
    for rank in range(8):
        distributed.init_fake_process_group(8, rank)
        try:
            mesh = build_expert_mesh(spec, "cpu")
            at = spec.coordinates(rank)
            ep_ranks = dist.get_process_group_ranks(mesh.get_group("ep"))
            assert (mesh.get_local_rank("ep"), mesh.get_local_rank("edp")) == (at["ep"], at["edp"])
            # Folded, ep takes the innermost ranks (tp neighbours first); else ranks tp apart.
            stride = 1 if spec.experts_fold_tp else spec.tp
            assert ep_ranks == [rank + (i - at["ep"]) * stride for i in range(spec.ep)]
        finally:
            dist.destroy_process_group()


def test_the_plan_shows_experts_split_over_the_folded_ranks(capsys):
    assert main(["--model", "tiny-moe", "--mesh", "dp=2,tp=2,ep=4,etp=1", "--print-plan"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("blocks.0.moe.experts.w_gate"))
    # [8 experts, 128, 64]: 2 per ep rank, and no tp copy; edp is 1.
    assert row.split()[1:] == ["expert,expert_mlp,embed", "ep:S(0)", "8x128x64", "2x128x64"]
    assert main(["--model", "tiny-moe", "--mesh", "dp=2,tp=2,ep=2", "--print-plan"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("blocks.0.moe.experts.w_gate"))
    assert row.split()[2:5] == ["ep:S(0)", "tp:R", "8x128x64"]


DRY = ["--model", "tiny-moe", "--model-overrides", "num_experts=32", "--seq-len", "256", "--micro-batch", "1",
       "--sequence-parallel", "--dry-run", "--world-size", "256"]


def test_a_256_rank_dry_run_builds_the_folded_experts():
    """pp=2, tp=4, dp=32, ep=32: without etp ep takes the 32 data ranks and every tp rank holds
    its ep rank's one expert; folded, ep takes 4 tp ranks x 8 data ranks and the 4 data ranks
    left (edp) shard that expert. Only the experts' bytes change, by the edp split."""
    reports = {}
    for name, mesh in (("beside", "pp=2,tp=4,ep=32"), ("folded", "pp=2,tp=4,ep=32,etp=1")):
        [(role, report)] = dry_run(resolved([*DRY, "--mesh", mesh, "--dry-run-rank", "0"], 256))
        assert role.first_rank == 0
        reports[name] = report
        assert report.collectives[("ep", "all-to-all")].count > 0
    layout = resolved([*DRY, "--mesh", "pp=2,tp=4,ep=32,etp=1"], 256)
    spec, blocks = layout.mesh, layout.pipeline.blocks_per_stage[0]
    expert_bytes = blocks * 3 * (32 // 32) * 128 * 64 * 4
    saved = expert_bytes * (1 - 1 / spec.edp)
    assert spec.edp == 4
    assert reports["beside"].param_bytes - reports["folded"].param_bytes == pytest.approx(saved)


def test_the_planner_predicts_and_searches_folded_layouts():
    flags = ["--model", "mixtral-8x7b", "--seq-len", "4096", "--micro-batch", "1", "--global-batch", "64",
             "--sequence-parallel"]
    h200 = Machine.gpu_profile("h200")
    beside = memory.predict_peak(resolved([*flags, "--mesh", "pp=2,tp=4,ep=8"], 64, h200))[0]
    folded = memory.predict_peak(resolved([*flags, "--mesh", "pp=2,tp=4,ep=8,etp=1"], 64, h200))[0]
    # The same ep, but the experts spread over 4x the ranks: a quarter of their fp32 state.
    assert folded.total < beside.total
    candidates = search(Target(model="mixtral-8x7b", gpus=16, seq_len=4096, global_batch=16, gpu_memory_gb=141))
    assert any("etp=1" in c.config.parallel.mesh for c in candidates)
