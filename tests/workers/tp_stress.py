"""Repeats sequence parallelism's chunked matmuls many times in one gloo group and checks every
result (several functional collectives in flight at once on gloo crashed runs now and
then; a pp=2,tp=2 run with SP died on SIGSEGV in the chunked reduce-scatter):

    python -m tests.workers.tp_stress OUT_DIR [ITERATIONS]   # 2 gloo processes

Each iteration runs q/k/v's gathered matmul and wo's scattered matmul of a block (parallel/
tensor_parallel.py, method `chunked`), forward and backward, on fresh random tensors, and compares
the forward outputs with whole-tensor math over plain collectives. Each rank writes rank<r>.json at
the end: the iterations done and the largest relative error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.tensor_parallel import AllGatherLinear, LinearReduceScatter, TpGroup

WORLD = 2
BATCH, SHARD, DIM = 2, 16, 64  # tokens per rank: SHARD; each chunk SHARD / WORLD


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _iteration(group: TpGroup, rank: int) -> float:
    x = torch.randn(BATCH, SHARD, DIM, requires_grad=True)
    wq, wkv = torch.randn(3 * DIM // 4, DIM, requires_grad=True), torch.randn(DIM // 4, DIM, requires_grad=True)
    wo = torch.randn(DIM, DIM, requires_grad=True)
    q, kv = AllGatherLinear.apply(x, group, "chunked", wq, wkv)
    h = torch.cat([q, kv], dim=-1)
    y = LinearReduceScatter.apply(h, group, "chunked", wo)
    y.square().sum().backward()
    with torch.no_grad():
        shards = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(shards, x.detach())
        whole = torch.cat(shards, dim=1)
        projected = torch.cat([whole @ wq.T, whole @ wkv.T], dim=-1)
        summed = projected @ wo.T
        dist.all_reduce(summed)
    return max(_relative_error(h.detach(), projected),
               _relative_error(y.detach(), summed[:, rank * SHARD:(rank + 1) * SHARD]))


def main(rank: int, out_dir: str, iterations: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD)
    group = TpGroup(dist.group.WORLD.group_name, WORLD, rank)
    torch.manual_seed(rank)
    worst = max(_iteration(group, rank) for _ in range(iterations))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"iterations": iterations, "max_relative_error": worst}))
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 500), nprocs=WORLD, join=True)
