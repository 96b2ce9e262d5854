"""The planner (python -m dtrain.planner), --mesh auto, --print-plan's memory, and the report of a
CUDA out-of-memory error."""

from __future__ import annotations

from dtrain.planner.candidates import Target
from dtrain.planner.search import search
from tests.unit.test_planner import GB


def test_a_model_with_multi_token_prediction_is_planned_with_pipelines():
    """DeepSeek-V3's MTP layer rides with the last stage: the split holds its 61 blocks, not 62."""
    candidates = search(Target(model="deepseek-v3", gpus=256, seq_len=4096, global_batch=1024, gpu_memory_gb=141))
    assert candidates and any("pp=" in c.config.parallel.mesh for c in candidates[:5])
    assert candidates[0].memory.total <= 141 * GB
