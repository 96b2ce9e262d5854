"""Run under torchrun by tests/integration/test_linear_cross_entropy.py: `python -m tests.workers.chunked_loss
DTRAIN_ARGS...` trains with the given flags (a tp mesh and --loss-chunk-tokens N) and fails unless
every loss of the head went through the chunked vocabulary-parallel path, on all the rank's tokens
and its vocabulary slice (never the logits of all tokens), or if torch.compile compiled any
function more than twice (as tests/workers/strict_recompiles.py)."""

import math
import os
import sys

import torch

from dtrain.run import main
from models import linear_cross_entropy
from parallel.context import ParallelContext
from tests.layouts import resolved

torch._dynamo.config.recompile_limit = 2
torch._dynamo.config.fail_on_recompile_limit_hit = True

layout = resolved(sys.argv[1:], int(os.environ["WORLD_SIZE"]))
config, vocab, tp = layout.config, layout.model_cfg.vocab_size, layout.mesh.tp
tokens = config.data.micro_batch * config.data.seq_len
seen: list[tuple[int, int, int]] = []  # (rows of h, rows of the weight, chunk tokens)
chunked = linear_cross_entropy.chunked_loss_and_gradients


def recording(h, weight, labels, chunk_tokens, **kwargs):
    seen.append((h.reshape(-1, h.shape[-1]).shape[0], weight.shape[0], chunk_tokens))
    return chunked(h, weight, labels, chunk_tokens, **kwargs)


def unfused(self, logits, labels):
    raise AssertionError(f"the unfused loss ran on logits of shape {tuple(logits.shape)}")


linear_cross_entropy.chunked_loss_and_gradients = recording
ParallelContext.cross_entropy_sum = unfused

if main(sys.argv[1:]) != 0:
    sys.exit("training failed")
slice_rows = {math.ceil(vocab / tp), vocab // tp}
assert seen and all(h_rows == tokens and rows in slice_rows and chunk == config.train.loss_chunk_tokens
                    for h_rows, rows, chunk in seen), seen
