"""Expert-parallel dispatch (parallel/expert_parallel.py) against the single-process experts: the
output, d(x) and each rank's local expert-weight (and expert-bias) gradients on every rank, for
Mixtral's, gpt-oss's and Llama 4's MoE layers, fp32 on CPU with gloo,
relative error <= 1e-5. One spawned group of 4 processes runs every case for ep=4 and for two
ep=2 groups (tests/workers/ep_dispatch.py). The exchange's collectives finish one at a time (left
in flight together, runs on gloo died on SIGSEGV now and then); tests/integration/test_collective_stress.py repeats the exchange hundreds of times."""

from __future__ import annotations

import pytest
import torch

from models.context import LocalContext
from models.errors import UserError
from parallel.expert_parallel import (ExpertParallelContextMixin, _expert_major_positions, choose_dispatch,
                                      experts_over_group)


def test_regrouping_orders_rows_by_local_expert_then_source_rank():
    # 3 source ranks x 2 local experts; rows arrive source-major.
    received_counts = torch.tensor([[2, 1], [0, 3], [1, 0]])
    arrival = [(src, e) for src in range(3) for e in range(2) for _ in range(int(received_counts[src, e]))]
    destination = _expert_major_positions(received_counts, len(arrival))
    regrouped = [None] * len(arrival)
    for position, label in zip(destination.tolist(), arrival):
        regrouped[position] = label
    assert regrouped == sorted(arrival, key=lambda label: (label[1], label[0]))


def test_without_expert_parallelism_it_is_the_local_path():
    class Context(ExpertParallelContextMixin, LocalContext):
        pass

    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 2, 1])
    x = torch.randn(6, 8, generator=generator)
    weights = [torch.randn(4, 12, 8, generator=generator), torch.randn(4, 12, 8, generator=generator),
               torch.randn(4, 8, 12, generator=generator)]
    expected = LocalContext().experts(x, counts, *weights)
    assert torch.equal(Context().experts(x, counts, *weights), expected)
    # Without an all-gather group, tokens take the row path (sorted by expert, then `experts`).
    ids, routing = torch.tensor([[0, 2], [3, 0], [2, 1]]), torch.rand(3, 2, generator=generator)
    assert Context().experts_on_tokens(x[:3], ids, routing, *weights) is None
    assert torch.equal(experts_over_group(x, counts, *weights, group=None), expected)


def test_auto_dispatch_takes_the_all_gather_where_it_sends_no_more_bytes():
    assert choose_dispatch("auto", ep=2, top_k=2, dropless=True) == "allgather"
    assert choose_dispatch("auto", ep=4, top_k=2, dropless=True) == "alltoall"  # 2x the all-to-all's bytes
    assert choose_dispatch("auto", ep=2, top_k=2, dropless=False) == "alltoall"  # it cannot drop tokens
    assert choose_dispatch("alltoall", ep=2, top_k=2, dropless=True) == "alltoall"
    with pytest.raises(UserError, match="unknown --ep-dispatch 'ring'"):
        choose_dispatch("ring", ep=2, top_k=2, dropless=True)
