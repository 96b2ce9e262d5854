"""Run under torchrun with 2 ranks: trains the tiny model at tp=2 with sequence parallelism for two
steps and checks that no rank ever holds the full-vocabulary logits: the loss sees vocab shards,
and no all-gather (DTensor's, or one fused into a matmul) produces a tensor with a full-vocabulary
dim. Extra arguments go to the run (`--tp-overlap none`: DTensor's gathers only)."""

import sys
import tempfile

import torch.distributed._functional_collectives as funcol

from dtrain.run import main
from models.presets import get_model_config
from parallel import tensor_parallel
from parallel.context import ParallelContext
from tests.launch import TINY_ARGS

VOCAB = get_model_config("tiny").vocab_size
gathered_shapes: list[tuple[int, ...]] = []
logits_local_shapes: list[tuple[int, ...]] = []

_cross_entropy_sum = ParallelContext.cross_entropy_sum


def recording(gather):
    def recording_all_gather(*args, **kwargs):
        out = gather(*args, **kwargs)
        gathered_shapes.append(tuple(out.shape))
        return out

    return recording_all_gather


def recording_fused(all_gather_matmul):
    def recording_all_gather_matmul(*args, **kwargs):
        gathered, outs = all_gather_matmul(*args, **kwargs)
        gathered_shapes.append(tuple(gathered.shape))
        return gathered, outs

    return recording_all_gather_matmul


def recording_cross_entropy_sum(self, logits, labels):
    logits_local_shapes.append(tuple(logits.to_local().shape))
    return _cross_entropy_sum(self, logits, labels)


# DTensor gathers through all_gather_single (torch 2.13) or all_gather_tensor (2.11).
for name in ("all_gather_single", "all_gather_tensor"):
    if hasattr(funcol, name):
        setattr(funcol, name, recording(getattr(funcol, name)))
tensor_parallel.all_gather_matmul = recording_fused(tensor_parallel.all_gather_matmul)
ParallelContext.cross_entropy_sum = recording_cross_entropy_sum

with tempfile.TemporaryDirectory() as run_dir:
    args = [*TINY_ARGS, "--run-dir", run_dir, "--mesh", "tp=2", "--sequence-parallel", "--steps", "2",
            *sys.argv[1:]]
    if main(args) != 0:
        sys.exit("training failed")

assert logits_local_shapes, "the loss was never computed"
assert all(shape[-1] == VOCAB // 2 for shape in logits_local_shapes), logits_local_shapes
# Sequence parallel all-gathers activations, never anything with a full-vocabulary dim.
assert gathered_shapes, "sequence parallel should all-gather activations"
assert all(VOCAB not in shape for shape in gathered_shapes), gathered_shapes
