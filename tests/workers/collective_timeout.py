"""Two gloo ranks whose groups start with a 60 s collective timeout; after
`set_collective_timeout(2, ...)` rank 1 skips an all-reduce on the default group and on a
subgroup, and rank 0 prints how long each took to fail: `timed out after S s`."""

import time

import torch
import torch.distributed as dist

from dtrain import distributed

distributed.init_process_group(timeout_s=60)
subgroup = dist.new_group([0, 1])
distributed.set_collective_timeout(2, distributed.process_groups())
if dist.get_rank() == 0:
    for group in (None, subgroup):
        started = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError:
            print(f"timed out after {time.perf_counter() - started:.1f} s", flush=True)
else:
    time.sleep(8)  # longer than rank 0's two timeouts, shorter than the groups' first ones
