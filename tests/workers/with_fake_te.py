"""Run under torchrun (or alone) by the tests of `--fp8-backend te`: `python -m
tests.workers.with_fake_te DTRAIN_ARGS...` trains with tests/fake_te.py standing in for
Transformer Engine. With STRICT_RECOMPILES=1 it fails if torch.compile compiles any function
more than twice (as tests/workers/strict_recompiles.py); COMPILE_BACKEND=aot_eager compiles with
that backend instead of inductor; with FAKE_TE_LOG=FILE each rank writes the calls TE received to
FILE.RANK (JSON lines)."""

import functools
import json
import os
import sys

import torch

from dtrain.run import main
from tests import fake_te

if os.environ.get("STRICT_RECOMPILES") == "1":
    torch._dynamo.config.recompile_limit = 2
    torch._dynamo.config.fail_on_recompile_limit_hit = True
if os.environ.get("COMPILE_BACKEND"):
    torch.compile = functools.partial(torch.compile, backend=os.environ["COMPILE_BACKEND"])
fake_te.install()
code = main(sys.argv[1:])
if os.environ.get("FAKE_TE_LOG"):
    with open(f"{os.environ['FAKE_TE_LOG']}.{os.environ.get('RANK', '0')}", "w") as log:
        log.writelines(json.dumps(call) + "\n" for call in fake_te.CALLS)
sys.exit(code)
