"""Spawned by tests/integration/test_context_parallel_attention.py: each of cp ranks (gloo on CPU, NCCL when run
by hand on GPUs) runs every case and method of context-parallel attention, compares its output and
dq/dk/dv with the matching rows of full causal attention of the unsplit sequence (every rank computes
that reference from the same seeded data), and writes the relative errors to rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from models.context import LocalContext, causal_attention
from models.errors import UserError
from parallel import masked_attention
from parallel.context_parallel import CP_METHODS, context_parallel_attention, mask_sites, shard_sequence

class Case(NamedTuple):
    batch: int
    seq_len: int  # divisible by 2 x 4
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # values of a head dim of their own (MLA)
    scale: float | None = None     # the scores' scale (None: head_dim ** -0.5)
    sinks: bool = False            # a sink logit per head (gpt-oss)


CASES = {
    "gqa_batch2": Case(2, 16, 4, 2, 8),
    "mha": Case(1, 8, 4, 4, 16),
    "gqa_8_4_long": Case(2, 32, 8, 4, 8),
    "mqa": Case(1, 16, 4, 1, 8),
    # DeepSeek's shapes in small: q/k head dim 24 (16 + 8 rotary), values 16, a YaRN-scaled softmax.
    "mla": Case(2, 16, 4, 4, 24, v_head_dim=16, scale=0.27),
    "gqa_sinks": Case(2, 16, 4, 2, 8, sinks=True),
}


# Masked cases: documents of these lengths in each row (a row of the batch each), a window, chunks.
MASKED_CASES = {
    "documents": (Case(2, 32, 4, 2, 8), [[5, 13, 1, 13], [32]], None, None),
    "documents_window": (Case(2, 32, 4, 2, 8), [[3, 20, 9], [12, 12, 8]], 6, None),
    "window": (Case(1, 32, 4, 4, 8), [[32]], 4, None),
    "short_documents": (Case(1, 32, 4, 1, 8), [[2, 3, 1, 4, 2, 5, 3, 6, 6]], None, None),
    # MLA's head dims and scale within documents and a window.
    "mla_documents_window": (Case(1, 32, 4, 4, 24, v_head_dim=16, scale=0.27), [[3, 20, 9]], 6, None),
    # Chunks of absolute positions (Llama 4), alone and within documents: most ring blocks are skipped.
    "chunks": (Case(1, 32, 4, 2, 8), [[32]], None, 8),
    "documents_chunks": (Case(2, 32, 4, 2, 8), [[3, 20, 9], [12, 12, 8]], None, 10),
    # gpt-oss's windowed layers: sinks on a window within documents.
    "window_sinks": (Case(2, 32, 4, 2, 8, sinks=True), [[3, 20, 9], [32]], 6, None),
}


def document_ids_of(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[number for number, n in enumerate(row) for _ in range(n)] for row in lengths])


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def _random_inputs(case: Case, seed, device="cpu", dtype=torch.float32):
    """q, k, v and the output's gradient."""
    generator = torch.Generator().manual_seed(seed)
    v_dim = case.v_head_dim or case.head_dim
    shapes = [(case.batch, case.seq_len, n, dim) for n, dim in ((case.heads, case.head_dim), (case.kv_heads, case.head_dim),
                                                                 (case.kv_heads, v_dim), (case.heads, v_dim))]
    return [torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes]


def _check_case(case: Case, seed, method, group, cp, rank, device="cpu", dtype=torch.float32,
                masked: tuple | None = None) -> dict[str, float]:
    """`masked`: (document ids [batch, seq], window, chunk) for attention within documents, the
    window and the chunks."""
    q, k, v, grad = _random_inputs(case, seed, device, dtype)
    sinks = torch.randn(case.heads, generator=torch.Generator().manual_seed(seed + 100)).to(device) if case.sinks else None
    # The reference is fp32 math attention of the same (possibly bf16-rounded) inputs, on one device
    # with the dense mask (LocalContext's meaning).
    full = [t.detach().to(torch.float32, copy=True).requires_grad_() for t in (q, k, v)]
    full_sinks = sinks.clone().requires_grad_() if case.sinks else None
    reference_mask = global_mask = None
    if masked is not None:
        reference_mask = LocalContext().attention_mask(*masked)
        reference_mask = type(reference_mask)(reference_mask.first_key.to(device), reference_mask.window,
                                              {n: f.to(device) for n, f in reference_mask.forms.items()})
        sites = mask_sites(method, case.seq_len, cp, rank)
        document_ids, window, chunk = masked
        global_mask = masked_attention.build_mask(
            document_ids, window, sites,
            lambda whole_row: masked_attention.choose_kernel("auto", torch.device(device).type, dtype, whole_row,
                                                                  window is not None),
            torch.device(device), chunk=chunk)
    reference = causal_attention(*full, reference_mask, case.scale, full_sinks)
    reference.backward(grad.float())
    expected = {"out": reference.detach(), "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}

    local = [shard_sequence(t, cp, rank).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_() if case.sinks else None
    out = context_parallel_attention(*local, group=group, method=method, mask=global_mask, scale=case.scale,
                                     sinks=local_sinks)
    out.backward(shard_sequence(grad, cp, rank).contiguous())
    actual = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    errors = {
        name: _relative_error(actual[name].float(), shard_sequence(expected[name], cp, rank)) for name in expected
    }
    if case.sinks:  # each rank's share of the sinks' gradient, summed over the group as data parallelism does
        grad_sinks = local_sinks.grad.clone()
        dist.all_reduce(grad_sinks, group=group)
        errors["dsinks"] = _relative_error(grad_sinks.float(), full_sinks.grad)
    return errors


def _user_error(*shape_and_method, group) -> str | None:
    *shape, method = shape_and_method
    q, k, v, _ = _random_inputs(Case(*shape), seed=0)
    try:
        context_parallel_attention(q, k, v, group=group, method=method)
    except UserError as error:
        return str(error)
    return None


def main(rank: int, cp: int, out_dir: str, device: str = "cpu", dtype_name: str = "float32") -> None:
    """On CPU (the tests) gloo and fp32; with device "cuda" (a manual check on GPUs) NCCL, one GPU a rank."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank, world_size=cp)
    group = dist.group.WORLD
    results: dict[str, object] = {}
    for seed, (name, case) in enumerate(CASES.items()):
        for method in CP_METHODS:
            if method == "a2a" and (case.heads % cp or case.kv_heads % cp):
                continue
            results[f"{name}/{method}"] = _check_case(case, seed + 1, method, group, cp, rank, device, dtype)
    for seed, (name, (case, lengths, window, chunk)) in enumerate(MASKED_CASES.items()):
        for method in CP_METHODS:
            if method == "a2a" and (case.heads % cp or case.kv_heads % cp):
                continue
            results[f"masked_{name}/{method}"] = _check_case(case, seed + 11, method, group, cp, rank, device,
                                                             dtype, (document_ids_of(lengths), window, chunk))
    results["error/a2a_kv_heads"] = _user_error(1, 4 * cp, 2 * cp, 1, 4, "a2a", group=group)
    results["error/a2a_heads"] = _user_error(1, 4 * cp, 2 * cp + 1, 1, 4, "a2a", group=group)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    # python -m tests.workers.cp_attention CP OUT_DIR [cpu|cuda] [float32|bfloat16]: prints rank 0's errors.
    import torch.multiprocessing as mp

    cp, out_dir = int(sys.argv[1]), sys.argv[2]
    mp.spawn(main, args=(cp, out_dir, *sys.argv[3:]), nprocs=cp, join=True)
    print(Path(out_dir, "rank0.json").read_text())
