"""Run under torchrun by tests/integration/test_data_parallel.py: `python -m tests.workers.count_grad_reductions
DTRAIN_ARGS...` trains with the given flags and counts FSDP's gradient reductions (one per FSDP
group per reducing backward) and parameter all-gathers. Rank 0 prints one line
`GRAD_REDUCTIONS n ALL_GATHERS m`."""

import sys

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from dtrain.run import main

counts = {"GRAD_REDUCTIONS": 0, "ALL_GATHERS": 0}


def counting(name: str, collective):
    def call(*args, **kwargs):
        counts[name] += 1
        return collective(*args, **kwargs)
    return call


_fsdp_param_group.foreach_reduce = counting("GRAD_REDUCTIONS", _fsdp_param_group.foreach_reduce)
_fsdp_param_group.foreach_all_gather = counting("ALL_GATHERS", _fsdp_param_group.foreach_all_gather)
original_shutdown = dist.destroy_process_group


def report_then_shutdown(*args, **kwargs):
    if dist.get_rank() == 0:
        print(" ".join(f"{name} {n}" for name, n in counts.items()), flush=True)
    return original_shutdown(*args, **kwargs)


dist.destroy_process_group = report_then_shutdown
sys.exit(main(sys.argv[1:]))
