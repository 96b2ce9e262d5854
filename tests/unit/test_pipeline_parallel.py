"""Pipeline parallelism: loss parity of every schedule against one process (CPU, gloo, fp32,
10 steps, relative difference <= 1e-4 at every step), the splitter, bad layouts, the micro-batches
each schedule holds at once, and the number of micro-batches taken without --global-batch."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from dtrain.layout.resolve import DEFAULT_MICROBATCHES_PER_STAGE
from models.errors import UserError
from parallel import pipeline
from tests.layouts import resolved


def test_balanced_layout_counts_the_head():
    # 16 blocks, 4 stages, a head that costs 1.5 blocks: the last stage gets fewer blocks.
    assert pipeline.balanced_layout(16, 4, 0.0, 1.5) == [4, 5, 4, 3]
    assert pipeline.balanced_layout(16, 4, 0.0, 0.0) == [4, 4, 4, 4]
    # Never an empty stage, even when the head outweighs everything.
    assert pipeline.balanced_layout(4, 4, 0.0, 10.0) == [1, 1, 1, 1]
    for blocks, stages, head in [(32, 8, 1.2), (126, 16, 2.7), (5, 4, 0.0)]:
        counts = pipeline.balanced_layout(blocks, stages, 0.0, head)
        assert sum(counts) == blocks and len(counts) == stages and min(counts) >= 1


def test_blocks_of_unequal_cost_are_split_by_their_costs():
    from models import flops, mixtral
    from models.presets import get_model_config

    # Eight blocks, the first four twice the cost of the others: 12 units over 2 stages is 3 + 3 blocks.
    assert pipeline.balanced_layout(8, 2, 0.0, 0.0, [4 / 3] * 4 + [2 / 3] * 4) == [3, 5]
    assert pipeline.balanced_layout(8, 2, 0.0, 0.0, [1.0] * 8) == [4, 4]
    # Dense blocks 4x wider than the MoE blocks' active experts (and their router): by cost, not count.
    cfg = get_model_config("tiny-moe", "num_layers=8,dense_layers=[0,1,2,3],dense_ffn_dim=1024,top_k=1")
    layers = mixtral.layers(cfg)
    costs = pipeline.block_costs(layers, flops.expert_share(cfg))
    assert costs[0] == costs[3] > 2 * costs[4] and costs[4] == costs[7] and abs(sum(costs) - 8) < 1e-9
    counts = pipeline.block_counts(layers, 2, expert_share=flops.expert_share(cfg))
    assert counts[0] < counts[1] and sum(counts) == 8
    first, rest = sum(costs[:counts[0]]), sum(costs[counts[0]:]) + pipeline.layer_costs(layers, flops.expert_share(cfg))[1]
    assert abs(first - rest) <= max(costs), (counts, first, rest)


def test_stage_assignment():
    assert pipeline.stage_ids(1, 4, 2, "interleaved-1f1b") == [1, 5]
    assert pipeline.stage_ids(1, 4, 2, "zbv") == [1, 6]
    from models import llama
    from models.presets import get_model_config

    layers = llama.layers(get_model_config("tiny"))
    names = [[layer.name for layer in pipeline.stage_layers(layers, [1, 3], s)] for s in (0, 1)]
    assert names == [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]]


BAD = [
    (dict(layout="1,2"), "places 3 blocks but the model has 4"),
    (dict(layout="4,0"), "every stage needs at least one block"),
    (dict(layout="1,1,2"), "names 3 stages but the mesh has 2"),
    (dict(layout="a,b"), "comma-separated block counts"),
    (dict(schedule="fancy"), "unknown --pp-schedule 'fancy'"),
    (dict(virtual=2), "runs one stage per rank"),
    (dict(schedule="zbv"), "needs --pp-virtual-stages 2"),
    (dict(micro=1), "fewer than pp=2 stages"),
    (dict(schedule="interleaved-1f1b", virtual=2, micro=3), "multiple of pp=2"),
    (dict(schedule="interleaved-1f1b", virtual=4, micro=4), "4 blocks cannot fill"),
    (dict(schedule="zbv", virtual=2, on_gpus=True), "does not finish a step over NCCL"),
    (dict(schedule="zb", virtual=2, on_gpus=True), "does not finish a step over NCCL"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_pipeline_settings(kwargs, message):
    args = dict(schedule="1f1b", pp=2, virtual=1, micro=4, blocks=4, layout=None, on_gpus=False) | kwargs
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeline.validate_schedule(args["schedule"], args["pp"], args["virtual"], args["blocks"], args["layout"],
                                   args["on_gpus"])
        pipeline.validate_microbatches(args["schedule"], args["pp"], args["micro"])


def _schedule(name: str, pp: int, pp_rank: int, virtual: int, num_microbatches: int):
    group = dist.new_group(list(range(pp)))
    ids = pipeline.stage_ids(pp_rank, pp, virtual, name)
    stages = [PipelineStage(torch.nn.Linear(2, 2), i, pp * virtual, torch.device("cpu"), group=group)
              for i in ids]
    return pipeline.build_schedule(stages, name, num_microbatches, lambda out, target: out.sum()), ids


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_activations_held_follow_the_schedule(fake_world, name):
    pp, m = 4, 8
    for pp_rank in range(pp):
        with fake_world(pp):
            schedule, ids = _schedule(name, pp, pp_rank, 1, m)
            profile = pipeline.activations_held(schedule, pp_rank, pp, ids, m)
            # Without the schedule's order table (older torch), its definition gives the same.
            schedule.__dict__.pop("pipeline_order", None)
            fallback = pipeline.activations_held(schedule, pp_rank, pp, ids, m)
        most = max(point[pp_rank] for point in profile)
        assert most == (m if name == "gpipe" else pp - pp_rank)
        assert max(point[pp_rank] for point in fallback) == most
        assert profile[-1] == {pp_rank: 0}  # every micro-batch's backward has run


def test_interleaved_schedule_holds_micro_batches_on_both_stages(fake_world):
    pp, m = 2, 4
    with fake_world(pp):
        schedule, ids = _schedule("interleaved-1f1b", pp, 0, 2, m)
        profile = pipeline.activations_held(schedule, 0, pp, ids, m)
    assert set(profile[0]) == set(ids) == {0, 2}
    assert any(point[0] and point[2] for point in profile)
    assert all(n >= 0 for point in profile for n in point.values()) and profile[-1] == {0: 0, 2: 0}


@pytest.mark.parametrize("mesh,world,schedule", [("pp=4,dp=2", 8, "1f1b"), ("pp=2", 2, "interleaved-1f1b"),
                                                 ("pp=2", 2, "zbv")])
def test_pipelines_without_global_batch_take_enough_micro_batches(mesh, world, schedule):
    args = ["--mesh", mesh, "--pp-schedule", schedule]
    if schedule != "1f1b":
        args += ["--pp-virtual-stages", "2", "--model-overrides", "num_layers=8"]
    layout = resolved(args, world)  # enough for every schedule, or this raises
    config, mesh_spec = layout.config, layout.mesh
    per_rank = config.data.global_batch // (config.data.micro_batch * mesh_spec.dp_size)
    assert per_rank == DEFAULT_MICROBATCHES_PER_STAGE * mesh_spec.pp
    assert pipeline.ideal_bubble(mesh_spec.pp, 1, per_rank) <= 1 / 3
