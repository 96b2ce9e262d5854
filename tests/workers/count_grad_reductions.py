"""Run under torchrun by tests/test_data_parallel.py: `python -m tests.workers.count_grad_reductions
DTRAIN_ARGS...` trains with the given flags and counts FSDP's gradient reductions (one per FSDP
group per reducing backward). Rank 0 prints one line `GRAD_REDUCTIONS n`."""

import sys

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from dtrain.run import main

reductions = 0
_foreach_reduce = _fsdp_param_group.foreach_reduce


def counting_foreach_reduce(*args, **kwargs):
    global reductions
    reductions += 1
    return _foreach_reduce(*args, **kwargs)


_fsdp_param_group.foreach_reduce = counting_foreach_reduce
original_shutdown = dist.destroy_process_group


def report_then_shutdown(*args, **kwargs):
    if dist.get_rank() == 0:
        print(f"GRAD_REDUCTIONS {reductions}", flush=True)
    return original_shutdown(*args, **kwargs)


dist.destroy_process_group = report_then_shutdown
sys.exit(main(sys.argv[1:]))
