"""Run under torchrun by tests/integration/test_moe_training.py: `python -m tests.workers.strict_recompiles
DTRAIN_ARGS...` trains with the given flags and fails if torch.compile compiles any function more
than twice (once with its first shapes and values, once with them dynamic). Past its recompile
limit torch would otherwise fall back to running the function uncompiled, silently."""

import sys

import torch

from dtrain.run import main

torch._dynamo.config.recompile_limit = 2
torch._dynamo.config.fail_on_recompile_limit_hit = True
sys.exit(main(sys.argv[1:]))
