"""Run under torchrun (NCCL, 2 GPUs) by tests/integration/test_fp8_all_gather.py: `python -m
tests.workers.fp8_all_gather LABEL DTRAIN_ARGS...` trains with the given flags and records what
the FP8 matmuls received (float8 weights from the all-gather, or bf16 ones) and, after each
optimizer step, whether the precomputed scales of the float8-gathered weights match their global
amax. Rank 0 prints one line `FP8_ALL_GATHER {json}`."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torchao.float8.float8_training_tensor import Float8TrainingTensor

from dtrain.run import main
from parallel import precision

counts = {"float8_weights": 0, "bf16_weights": 0, "precomputed_steps": 0, "scale_errors": []}
_call = precision.Float8Linear.__call__
_after_step = precision.after_optimizer_step


def recording_call(self, x, weight):
    counts["float8_weights" if isinstance(weight, Float8TrainingTensor) else "bf16_weights"] += 1
    return _call(self, x, weight)


def checking_after_step(model_parts):
    _after_step(model_parts)
    params = precision.float8_gathered_params(model_parts)
    if not params:
        return
    counts["precomputed_steps"] += 1
    for param in params:
        local = param._local_tensor
        amax = local._tensor.abs().max().float().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=param.device_mesh.get_group())
        expected = (torch.finfo(local._dtype).max / amax.double()).float()[0]
        scale = local._precomputed_scale
        if scale is None or not torch.allclose(scale, expected, rtol=1e-6):
            counts["scale_errors"].append([None if scale is None else scale.item(), expected.item()])


precision.Float8Linear.__call__ = recording_call
precision.after_optimizer_step = checking_after_step

label, *args = sys.argv[1:]
if main(args) != 0:
    sys.exit(f"{label}: training failed")
if os.environ.get("RANK", "0") == "0":
    print("FP8_ALL_GATHER " + json.dumps(counts), flush=True)
