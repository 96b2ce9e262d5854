"""Repeats the expert-parallel exchange many times in one process group, as training does, and
checks every result (with several functional collectives in flight at once, runs on gloo crashed
now and then):

    python -m tests.workers.ep_stress OUT_DIR [ITERATIONS [RUNS]]   # 2 gloo processes

Each iteration runs every case of tests/workers/ep_dispatch.py on the ep=2 group, which is the
default group here as in a `--mesh dp=2,ep=2` run (both dispatches, forward and backward, uneven
routing, a rank that sends nothing, a rank whose experts get no token, DTensor inputs, the whole
MoE layer), then a forward and backward of an FSDP-sharded module on the same group, so that
FSDP's collectives come between the exchanges as they do in training. After each run of
ITERATIONS iterations rank 0 appends "run K ok ERROR" to OUT_DIR/runs.log; a memory fault kills
the processes instead, and the log shows which run it was in. Each rank writes rank<r>.json at the
end: the iterations done and the largest relative error of any output or gradient against one
process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.workers import ep_dispatch

WORLD = 2


def _fsdp_module(mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(ep_dispatch.EMBED, 64), torch.nn.Linear(64, ep_dispatch.EMBED))
    for layer in module:
        fully_shard(layer, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def _iteration(seed: int, mesh, rank: int, fsdp: torch.nn.Module) -> float:
    """The largest relative error of this rank's outputs and gradients over every case."""
    worst = 0.0
    for index, case in enumerate(ep_dispatch.CASES):
        check = ep_dispatch._check_token_case if case.startswith("allgather") else ep_dispatch._check_case
        worst = max(worst, *check(case, seed + index, mesh, rank).values())
    for dispatch in ("alltoall", "allgather"):
        worst = max(worst, *ep_dispatch._check_moe_forward(seed + 9, mesh, rank, dispatch).values())
    fsdp(torch.randn(8, ep_dispatch.EMBED)).square().sum().backward()
    return worst


def main(rank: int, out_dir: str, iterations: int, runs: int = 1) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    fsdp = _fsdp_module(mesh)
    worst, started = 0.0, time.perf_counter()
    for run in range(runs):
        run_worst = max(_iteration(1000 * (run * iterations + i), mesh, rank, fsdp) for i in range(iterations))
        worst = max(worst, run_worst)
        dist.barrier()
        if rank == 0:
            with open(Path(out_dir, "runs.log"), "a") as log:
                log.write(f"run {run} ok {run_worst:.3g}\n")
    result = {"iterations": runs * iterations, "max_relative_error": worst, "seconds": time.perf_counter() - started}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    out_dir = sys.argv[1]
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    mp.spawn(main, args=(out_dir, iterations, runs), nprocs=WORLD, join=True)
    print(Path(out_dir, "rank0.json").read_text())
