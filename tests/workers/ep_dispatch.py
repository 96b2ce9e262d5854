"""Spawned by tests/integration/test_expert_parallel.py as 4 gloo ranks, which form one ep=4 group and two ep=2
groups ({0, 1} and {2, 3}). In each group every rank runs every case of the expert-parallel
`experts` seam on its own tokens and its block of experts, compares the output,
d(x) and the gradients of its local expert weights with a single-process reference over every
rank's tokens and all experts, and writes the relative errors to rank<r>.json.

The loss is the sum over all ranks of (output * upstream gradient), so a local expert's weight
gradient must equal the reference gradient rows of those experts accumulated over every rank's tokens.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models import moe, spec
from models.config import MoEConfig
from models.family_configs import GptOssConfig, Llama4Config
from models.context import LocalContext, grouped_swiglu
from models.errors import UserError
from parallel.expert_parallel import (ExpertParallelContextMixin, expert_parallel_swiglu,
                                      expert_parallel_tokens_allgather)

NUM_EXPERTS, EMBED, MLP = 8, 16, 24
# "cpu" in the tests; main sets "cuda:<rank>" for a manual check on GPUs (NCCL, grouped GEMM).
_device = "cpu"
CASES = ("uneven", "one_rank_sends_nothing", "one_rank_receives_nothing", "dtensor_inputs_via_mixin",
         # --ep-dispatch allgather (`experts_on_tokens`): the same number of routed tokens on every
         # rank, spread unevenly over the experts; through the expert loop, and through the grouped
         # GEMM with its masked rows.
         "allgather", "allgather_one_rank_receives_nothing", "allgather_grouped_mm",
         "allgather_dtensor_inputs_via_mixin")
ALLGATHER_TOKENS, TOP_K = 10, 2


class _ExpertParallelContext(ExpertParallelContextMixin, LocalContext):
    def __init__(self, group, ep_dispatch: str = "alltoall"):
        self.ep_group = group
        self.ep_dispatch = ep_dispatch


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0 if actual.shape == expected.shape else float("inf")
    # Experts that no rank routes to have exactly zero gradient; the clamp keeps that exact.
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _counts(case: str, rank: int, ep: int, generator: torch.Generator) -> torch.Tensor:
    counts = torch.randint(0, 7, (NUM_EXPERTS,), generator=generator)
    counts[3] = 0  # an expert that no rank routes to
    counts[0] = 5 + rank  # uneven over ranks, and never an empty rank by chance
    if case == "one_rank_sends_nothing" and rank == 1:
        counts.zero_()
    if case == "one_rank_receives_nothing":
        counts[-NUM_EXPERTS // ep:] = 0  # the last rank's experts get no tokens from anyone
    return counts


def _expert_weights(generator: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randn(shape, generator=generator) * 0.3).to(_device)
            for shape in ((NUM_EXPERTS, MLP, EMBED), (NUM_EXPERTS, MLP, EMBED), (NUM_EXPERTS, EMBED, MLP))]


def _inputs(case: str, seed: int, ep: int):
    """Every rank's (x, counts, upstream gradient) and the full expert weights, the same on each rank."""
    generator = torch.Generator().manual_seed(seed)
    weights = _expert_weights(generator)
    per_rank = []
    for rank in range(ep):
        counts = _counts(case, rank, ep, generator)
        rows = int(counts.sum())
        x = torch.rand(rows, EMBED, generator=generator) + 0.5  # never zero
        grad = torch.randn(rows, EMBED, generator=generator)
        per_rank.append((x.to(_device), counts.to(_device), grad.to(_device)))
    return per_rank, weights


def _reference(per_rank, weights):
    """Outputs and d(x) per rank, and the full weights' gradients summed over every rank's tokens."""
    full = [w.clone().requires_grad_() for w in weights]
    outputs, x_grads = [], []
    for x, counts, grad in per_rank:
        x = x.clone().requires_grad_()
        out = LocalContext().experts(x, counts, *full)
        (out * grad).sum().backward()
        outputs.append(out.detach())
        x_grads.append(x.grad)
    return outputs, x_grads, [w.grad for w in full]


def _check_case(case: str, seed: int, mesh, rank: int) -> dict[str, float]:
    """`mesh` is the 1-D ep mesh of this rank's group; `rank` its rank in that group."""
    group, ep = mesh.get_group(), mesh.size()
    per_rank, weights = _inputs(case, seed, ep)
    ref_out, ref_dx, ref_dw = _reference(per_rank, weights)
    block = slice(rank * NUM_EXPERTS // ep, (rank + 1) * NUM_EXPERTS // ep)

    x, counts, grad = per_rank[rank]
    x = x.clone().requires_grad_()
    if case.endswith("dtensor_inputs_via_mixin"):
        # DTensor weights sharded over ep, and x as a DTensor whose local rows are this rank's tokens.
        local = [distribute_tensor(w, mesh, [Shard(0)]).requires_grad_() for w in weights]
        x_rows = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
        out = _ExpertParallelContext(group).experts(x_rows, counts, *local)
        assert isinstance(out, DTensor) and out.placements == x_rows.placements
        out = out.to_local()
    else:
        local = [w[block].clone().requires_grad_() for w in weights]
        out = expert_parallel_swiglu(x, counts, *local, group=group, num_experts=NUM_EXPERTS)
    (out * grad).sum().backward()
    dw = [w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad for w in local]
    errors = {"out": _relative_error(out.detach(), ref_out[rank]), "dx": _relative_error(x.grad, ref_dx[rank])}
    errors.update({f"d{name}": _relative_error(actual, expected[block])
                   for name, actual, expected in zip(("w_gate", "w_up", "w_down"), dw, ref_dw)})
    return errors



def _token_inputs(case: str, seed: int, ep: int):
    """Every rank's (tokens, expert ids, routing weights, upstream gradient) and the full expert weights."""
    generator = torch.Generator().manual_seed(seed)
    weights = _expert_weights(generator)
    chosen = torch.ones(NUM_EXPERTS)
    chosen[3] = 0  # an expert that no rank routes to
    if case == "allgather_one_rank_receives_nothing":
        chosen[-NUM_EXPERTS // ep:] = 0  # the last rank's experts get no tokens from anyone
    per_rank = []
    for _ in range(ep):
        ids = torch.stack([torch.multinomial(chosen, TOP_K, generator=generator) for _ in range(ALLGATHER_TOKENS)])
        routing = torch.rand(ALLGATHER_TOKENS, TOP_K, generator=generator) + 0.1
        x = torch.rand(ALLGATHER_TOKENS, EMBED, generator=generator) + 0.5
        grad = torch.randn(ALLGATHER_TOKENS, EMBED, generator=generator)
        per_rank.append(tuple(t.to(_device) for t in (x, ids, routing, grad)))
    return per_rank, weights


def _token_reference(per_rank, weights):
    """Outputs, d(x) and d(routing weights) per rank, by the row path of one process (sort by
    expert, all experts, combine), and the full weights' gradients summed over every rank's tokens."""
    full = [w.clone().requires_grad_() for w in weights]
    outputs, x_grads, routing_grads = [], [], []
    for x, ids, routing, grad in per_rank:
        x, routing = x.clone().requires_grad_(), routing.clone().requires_grad_()
        slots = torch.argsort(ids.flatten(), stable=True)
        counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
        rows = LocalContext().experts(x[slots // TOP_K], counts, *full)
        out = moe.combine(rows, routing, slots)
        (out * grad).sum().backward()
        outputs.append(out.detach())
        x_grads.append(x.grad)
        routing_grads.append(routing.grad)
    return outputs, x_grads, routing_grads, [w.grad for w in full]


def _check_token_case(case: str, seed: int, mesh, rank: int) -> dict[str, float]:
    """`_check_case` for `experts_on_tokens` by all-gather; also compares d(routing weights)."""
    group, ep = mesh.get_group(), mesh.size()
    per_rank, weights = _token_inputs(case, seed, ep)
    ref_out, ref_dx, ref_drouting, ref_dw = _token_reference(per_rank, weights)
    block = slice(rank * NUM_EXPERTS // ep, (rank + 1) * NUM_EXPERTS // ep)

    x, ids, routing, grad = per_rank[rank]
    x, routing = x.clone().requires_grad_(), routing.clone().requires_grad_()
    if case.endswith("dtensor_inputs_via_mixin"):
        local = [distribute_tensor(w, mesh, [Shard(0)]).requires_grad_() for w in weights]
        tokens = [DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in (x, ids, routing)]
        out = _ExpertParallelContext(group, "allgather").experts_on_tokens(*tokens, *local)
        assert isinstance(out, DTensor) and out.placements == tokens[0].placements
        out = out.to_local()
    else:
        local = [w[block].clone().requires_grad_() for w in weights]
        swiglu = functools.partial(grouped_swiglu, use_grouped_mm=case == "allgather_grouped_mm")
        out = expert_parallel_tokens_allgather(x, ids, routing, *local, group=group, num_experts=NUM_EXPERTS,
                                               swiglu=swiglu)
    (out * grad).sum().backward()
    dw = [w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad for w in local]
    errors = {"out": _relative_error(out.detach(), ref_out[rank]), "dx": _relative_error(x.grad, ref_dx[rank]),
              "drouting": _relative_error(routing.grad, ref_drouting[rank])}
    errors.update({f"d{name}": _relative_error(actual, expected[block])
                   for name, actual, expected in zip(("w_gate", "w_up", "w_down"), dw, ref_dw)})
    return errors

# The MoE layer's variants: Mixtral's, gpt-oss's (biased experts with the clamped SwiGLU, a biased
# router) and Llama 4's (sigmoid top-1 whose score scales the expert's input).
MOE_VARIANTS = {
    "plain": (MoEConfig, {"top_k": 2}),
    "gpt_oss": (GptOssConfig, {"top_k": 2}),
    "llama4": (Llama4Config, {"num_shared_experts": 0}),
}


def _check_moe_forward(seed: int, mesh, rank: int, dispatch: str, variant: str = "plain") -> dict[str, float]:
    """The whole MoE layer (routing, dispatch, combine, aux loss) with the expert-parallel context;
    uneven token counts over ranks for the all-to-all."""
    group, ep = mesh.get_group(), mesh.size()
    config_cls, fields = MOE_VARIANTS[variant]
    cfg = config_cls(dim=EMBED, num_layers=1, num_heads=2, num_kv_heads=2, vocab_size=32, num_experts=NUM_EXPERTS,
                     expert_ffn_dim=MLP, **fields)
    generator = torch.Generator().manual_seed(seed)
    params = {name: (torch.randn(s.shape, generator=generator) * (0.3 if s.std else 1.0) + (0.1 if not s.std else 0))
              .to(_device) for name, s in spec.flatten(moe.moe_params(cfg, 1.0, 1.0))}
    tokens = [tuple(torch.randn(2, 3 + (r if dispatch == "alltoall" else 0), EMBED, generator=generator).to(_device)
                    for _ in range(2)) for r in range(ep)]
    full = {name: w.clone().requires_grad_() for name, w in params.items()}
    for r, (x, grad) in enumerate(tokens):
        x = x.clone().requires_grad_()
        out = moe.moe_forward(spec.unflatten(full), x, cfg, LocalContext())
        (out * grad).sum().backward()
        if r == rank:
            ref_out, ref_dx = out.detach(), x.grad

    block = slice(rank * NUM_EXPERTS // ep, (rank + 1) * NUM_EXPERTS // ep)
    local = {name: (w[block] if name.startswith("experts.") else w).clone().requires_grad_() for name, w in params.items()}
    x, grad = tokens[rank][0].clone().requires_grad_(), tokens[rank][1]
    out = moe.moe_forward(spec.unflatten(local), x, cfg, _ExpertParallelContext(group, dispatch))
    (out * grad).sum().backward()
    errors = {"out": _relative_error(out.detach(), ref_out), "dx": _relative_error(x.grad, ref_dx)}
    errors.update({f"d{name.removeprefix('experts.')}": _relative_error(local[name].grad, full[name].grad[block])
                   for name in params if name.startswith("experts.")})
    return errors


def _raised(call) -> str | None:
    """`Kind: message` of the error `call()` raises (a user's UserError or an invariant's assert)."""
    try:
        call()
    except (UserError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _user_errors(mesh_2d) -> dict[str, str | None]:
    group, ep = mesh_2d["ep"].get_group(), mesh_2d["ep"].size()
    x, counts = torch.ones(4, EMBED), torch.tensor([4] + [0] * (2 * ep))  # 2 * ep + 1 experts
    w = torch.ones(2, MLP, EMBED)
    errors = {"indivisible": _raised(
        lambda: expert_parallel_swiglu(x, counts, w, w, w.transpose(1, 2), group=group, num_experts=2 * ep + 1))}
    counts, w = torch.tensor([4] + [0] * (NUM_EXPERTS - 1)), torch.ones(NUM_EXPERTS // ep + 1, MLP, EMBED)
    errors["wrong_block"] = _raised(
        lambda: expert_parallel_swiglu(x, counts, w, w, w.transpose(1, 2), group=group, num_experts=NUM_EXPERTS))
    # Expert weights whose mlp dim is also split (over "dp" here, as a plan mapping mlp -> tp would).
    w = distribute_tensor(torch.ones(NUM_EXPERTS, MLP, EMBED), mesh_2d, [Shard(1), Shard(0)])
    errors["mlp_split"] = _raised(
        lambda: _ExpertParallelContext(group).experts(x, counts, w, w, w.transpose(1, 2)))
    return errors


def main(rank: int, out_dir: str, device: str = "cpu") -> None:
    global _device
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        _device = f"cuda:{rank}"
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank, world_size=4)
    meshes = {4: init_device_mesh(device, (4,), mesh_dim_names=("ep",))}
    mesh_2d = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "ep"))
    meshes[2] = mesh_2d["ep"]
    results: dict[str, object] = {}
    for ep, mesh in meshes.items():
        # The two ep=2 groups get different data; the group rank, not the global rank, picks the experts.
        seed = 100 * ep + 10 * (rank // ep)
        group_rank = mesh.get_local_rank()
        for index, case in enumerate(CASES):
            check = _check_token_case if case.startswith("allgather") else _check_case
            results[f"ep{ep}/{case}"] = check(case, seed + index, mesh, group_rank)
        for dispatch in ("alltoall", "allgather"):
            results[f"ep{ep}/moe_forward_{dispatch}"] = _check_moe_forward(seed + 9, mesh, group_rank, dispatch)
            for variant in ("gpt_oss", "llama4"):
                results[f"ep{ep}/moe_forward_{dispatch}_{variant}"] = _check_moe_forward(seed + 9, mesh, group_rank,
                                                                                          dispatch, variant)
    results["errors"] = _user_errors(mesh_2d)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    # python -m tests.workers.ep_dispatch OUT_DIR [cpu|cuda]: prints rank 0's errors (cuda: 4 GPUs).
    import torch.multiprocessing as mp

    out_dir = sys.argv[1]
    mp.spawn(main, args=(out_dir, *sys.argv[2:]), nprocs=4, join=True)
    print(Path(out_dir, "rank0.json").read_text())
