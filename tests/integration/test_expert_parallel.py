"""Expert-parallel dispatch (parallel/expert_parallel.py) against the single-process experts: the
output, d(x) and each rank's local expert-weight (and expert-bias) gradients on every rank, for
Mixtral's, gpt-oss's and Llama 4's MoE layers, fp32 on CPU with gloo,
relative error <= 1e-5. One spawned group of 4 processes runs every case for ep=4 and for two
ep=2 groups (tests/workers/ep_dispatch.py). The exchange's collectives finish one at a time (left
in flight together, runs on gloo died on SIGSEGV now and then); tests/integration/test_collective_stress.py repeats the exchange hundreds of times."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.expert_parallel import (expert_parallel_swiglu, expert_parallel_tokens_allgather)
from tests.workers import ep_dispatch


RTOL = 1e-5


WORLD = 4


EP_SIZES = (2, 4)


MOE_FORWARDS = [f"moe_forward_{dispatch}{variant}" for dispatch in ("alltoall", "allgather")
                for variant in ("", "_gpt_oss", "_llama4")]


RUNS = [f"ep{ep}/{case}" for ep in EP_SIZES for case in (*ep_dispatch.CASES, *MOE_FORWARDS)]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ep")
    mp.spawn(ep_dispatch.main, args=(str(out_dir),), nprocs=WORLD, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("run", RUNS)
def test_matches_all_experts_on_one_process_on_every_rank(rank_results, run):
    for rank, results in enumerate(rank_results):
        errors = results[run]
        token_case = "allgather" in run and "moe_forward" not in run  # also checks the routing weights' gradient
        biased = run.endswith("gpt_oss")  # the experts' biases, sharded with them, get their gradients too
        assert set(errors) == ({"out", "dx", "dw_gate", "dw_up", "dw_down"} | ({"drouting"} if token_case else set())
                               | ({"db_gate", "db_up", "db_down"} if biased else set()))
        for name, error in errors.items():
            assert error <= RTOL, f"rank {rank} {run}: {name} relative error {error:.2e}"


def test_a_plan_that_splits_the_experts_inner_dims_is_a_user_error_and_wrong_sizes_are_bugs(rank_results):
    """The plan is the user's (its rules may split an expert's mlp dim); the expert counts and the
    blocks of experts per rank are the layout's, checked before any work: a mismatch there is a bug."""
    for results in rank_results:
        errors = results["errors"]
        assert errors["indivisible"].startswith("AssertionError: (5, 2)")
        assert errors["wrong_block"].startswith("AssertionError: ") and "4)" in errors["wrong_block"]
        assert errors["mlp_split"].startswith("UserError: ") and "S(1)" in errors["mlp_split"]
        assert "'dp'" in errors["mlp_split"]


class _CollectiveOps(TorchDispatchMode):
    """The names of the functional collective ops run (the collectives and their waits), in order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_each_collective_has_finished_before_the_next_starts(one_rank_group):
    # gloo runs collectives on worker threads; the all-gather dispatch once left three in flight
    # while it went on computing, and runs crashed now and then.
    generator = torch.Generator().manual_seed(0)
    experts, tokens = 4, 6
    weights = [torch.randn(shape, generator=generator).requires_grad_() for shape in
               ((experts, 12, 8), (experts, 12, 8), (experts, 8, 12))]
    x = torch.randn(tokens, 8, generator=generator, requires_grad=True)
    ids = torch.tensor([[0, 2], [3, 0], [2, 1], [1, 3], [0, 1], [2, 3]])
    routing = torch.rand(tokens, 2, generator=generator, requires_grad=True)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    rows = torch.randn(int(counts.sum()), 8, generator=generator, requires_grad=True)
    for name, run in {
        "allgather": lambda: expert_parallel_tokens_allgather(x, ids, routing, *weights, group=one_rank_group,
                                                              num_experts=experts),
        "alltoall": lambda: expert_parallel_swiglu(rows, counts, *weights, group=one_rank_group, num_experts=experts),
    }.items():
        with _CollectiveOps() as seen:
            run().square().sum().backward()
        collectives, waits = seen.names[0::2], seen.names[1::2]
        assert waits == ["wait_tensor"] * len(collectives) and "wait_tensor" not in collectives, (name, seen.names)
        # Forward and backward: the all-gather dispatch gathers tokens, ids and routing weights and
        # reduce-scatters; backward gathers once and reduce-scatters twice (ids have no gradient).
        # The all-to-all sends counts, rows and rows back; backward sends both row exchanges back.
        assert len(collectives) == {"allgather": 7, "alltoall": 5}[name], (name, seen.names)
