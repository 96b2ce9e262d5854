"""The planner and the dry run on today's families: attention time by layer kind (windowed and
chunked layers attend fewer keys), dense and MoE blocks apart, the largest Qwen3-MoE and gpt-oss
planned on 256 GPUs, and the dry run building them at that size (one pipeline rank's program)."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from dtrain.inspect.dry_run import dry_run
from dtrain.planner.candidates import Target
from dtrain.planner.search import search
from models import spec
from parallel import pipeline
from tests.layouts import resolved
from tests.unit.test_family_planning import DRY_RUNS, GB


@pytest.mark.parametrize("model", ["qwen3-235b-a22b", "gpt-oss-120b"])
def test_the_largest_families_are_planned_on_256_gpus(model):
    candidates = search(Target(model=model, gpus=256, seq_len=4096, global_batch=1024, gpu_memory_gb=141))
    assert candidates
    best = candidates[0]
    assert best.memory.total <= 141 * GB
    assert "ep=" in best.config.parallel.mesh  # 128 experts are split over ranks
    assert best.tokens_per_sec_per_gpu > 0


@pytest.mark.parametrize("model", list(DRY_RUNS))
def test_the_dry_run_builds_them_on_256_ranks(model, capsys):
    """The first pipeline rank's program: its stages' parameters as the plan shards them (experts
    over ep and edp, the rest over dp_shard), and the experts' exchange over ep."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    args = ["--dry-run", "--world-size", "256", "--model", model, "--seq-len", "4096", "--global-batch", "1024",
            "--precision", "bf16", "--dry-run-rank", "0", *DRY_RUNS[model]]
    layout = resolved(args, 256)
    [(_, report)] = dry_run(layout)
    mesh_spec, model_cfg, split = layout.mesh, layout.model_cfg, layout.pipeline
    held_layers = [layer for stage in split.stage_ids(0) for layer in
                   pipeline.stage_layers(layout.layers, list(split.blocks_per_stage), stage)]
    held = [param for layer in held_layers for _, param in spec.flatten(layer.params)]
    at = mesh_spec.coordinates(0)
    assert report.param_bytes == sum(math.prod(layout.plan.local_shape(q.shape, q.axes, at)) * 4 for q in held)
    moe_blocks = sum(1 for name in {layer.name for layer in held_layers}
                     if name.startswith("blocks.") and model_cfg.is_moe_layer(int(name.split(".")[1])))
    exchanges = [tally.count for (dim, _), tally in report.collectives.items() if dim == "ep" and tally.bytes > 8]
    # At least one exchange per MoE block and micro-batch.
    assert moe_blocks and sum(exchanges) >= layout.num_microbatches * moe_blocks
    assert "peak memory" in capsys.readouterr().out
