"""Run under torchrun by tests/test_linear_cross_entropy.py: `python -m tests.workers.chunked_loss
DTRAIN_ARGS...` trains with the given flags (a tp mesh and --loss-chunk-tokens N) and fails unless
every loss of the head went through the chunked vocabulary-parallel path, on this rank's vocabulary
slice, `tokens / N` chunks (rounded up) at a time: never the logits of all tokens."""

import math
import os
import sys

from dtrain.config import load_config
from dtrain.run import main
from models import linear_cross_entropy
from models.config import get_model_config
from parallel import tensor_parallel
from parallel.context import ParallelContext
from parallel.mesh import MeshSpec

config = load_config(sys.argv[1:])
vocab = get_model_config(config.model.model, config.model.model_overrides).vocab_size
chunk = config.train.loss_chunk_tokens
tp = MeshSpec.parse(config.parallel.mesh, int(os.environ["WORLD_SIZE"])).tp
tokens = config.data.micro_batch * config.data.seq_len
seen: list[tuple[int, int, int]] = []  # (chunks, local vocabulary rows, rows of h)
chunked = linear_cross_entropy.chunked_loss_and_gradients


def recording(h, weight, labels, chunk_tokens, **kwargs):
    seen.append((math.ceil(h.reshape(-1, h.shape[-1]).shape[0] / chunk_tokens), weight.shape[0],
                 h.reshape(-1, h.shape[-1]).shape[0]))
    return chunked(h, weight, labels, chunk_tokens, **kwargs)


def unfused(self, logits, labels):
    raise AssertionError(f"the unfused loss ran on logits of shape {tuple(logits.shape)}")


tensor_parallel.chunked_loss_and_gradients = recording
ParallelContext.cross_entropy_sum = unfused

if main(sys.argv[1:]) != 0:
    sys.exit("training failed")
assert seen, "the chunked loss never ran"
slice_rows = {math.ceil(vocab / tp), vocab // tp}
assert all(rows in slice_rows and h_rows == tokens and chunks == math.ceil(tokens / chunk)
           for chunks, rows, h_rows in seen), seen
