"""dtrain's context-parallel attention (allgather, ring, a2a) against full causal attention of the
unsplit sequence, plain and within documents, sliding windows and chunks, with and without attention
sinks (the dense mask on one device):
output and dq/dk/dv on every rank, fp32 on CPU with gloo, relative error <= 1e-5.
One spawned process group per cp size runs every case (tests/workers/cp_attention.py).
The ring's block kernels (out + log-sum-exp forward, backward from the merged out and lse) are checked
one block at a time against math attention; on 2 GPUs (marked gpu) the ring runs in bf16 with each of
the cuDNN and flash kernels against full fp32 attention on one GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.context import causal_attention
from models.errors import UserError
from parallel import attention_blocks as blocks
from parallel import ring_attention as ring
from parallel.context_parallel import CP_METHODS, context_parallel_attention, load_balance_indices, shard_sequence
from tests.workers import cp_attention

RTOL = 1e-5
CP_SIZES = (2, 4)


@pytest.fixture(scope="module")
def spawned_results(tmp_path_factory):
    """cp -> per-rank result dicts, each group spawned once and only when a test asks for it."""
    cache: dict[int, list[dict] | Exception] = {}

    def results(cp: int) -> list[dict]:
        if cp not in cache:
            out_dir = tmp_path_factory.mktemp(f"cp{cp}")
            try:
                mp.spawn(cp_attention.main, args=(cp, str(out_dir)), nprocs=cp, join=True)
                cache[cp] = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(cp)]
            except Exception as error:  # a broken group fails each of its tests once, not respawned
                cache[cp] = error
        if isinstance(cache[cp], Exception):
            raise cache[cp]
        return cache[cp]

    return results


def _expected_runs(cp: int) -> list[str]:
    runs = []
    shapes = {**cp_attention.CASES, **{f"masked_{name}": case[0] for name, case in cp_attention.MASKED_CASES.items()}}
    for name, case in shapes.items():
        for method in CP_METHODS:
            if method != "a2a" or (case.heads % cp == 0 and case.kv_heads % cp == 0):
                runs.append(f"{name}/{method}")
    return runs


RUNS = [(cp, run) for cp in CP_SIZES for run in _expected_runs(cp)]


@pytest.mark.parametrize("cp,run", RUNS, ids=[f"cp{cp}-{run}" for cp, run in RUNS])
def test_matches_full_causal_attention_on_every_rank(spawned_results, cp, run):
    for rank, results in enumerate(spawned_results(cp)):
        errors = results[run]
        for name, error in errors.items():
            assert error <= RTOL, f"cp={cp} rank {rank} {run}: {name} relative error {error:.2e}"


@pytest.mark.parametrize("cp", CP_SIZES)
def test_every_method_runs_gqa_and_batch(cp):
    methods = {run.split("/")[1] for run in _expected_runs(cp)}
    assert methods == set(CP_METHODS)
    masked = [run for run in _expected_runs(cp) if run.startswith("masked_")]
    assert {run.split("/")[1] for run in masked} == set(CP_METHODS)
    gqa = [run for run in _expected_runs(cp) if run.startswith("gqa_batch2") or run.startswith("gqa_8_4")]
    assert {run.split("/")[1] for run in gqa} == set(CP_METHODS)


@pytest.mark.parametrize("cp", CP_SIZES)
def test_a2a_names_the_heads_that_do_not_divide(spawned_results, cp):
    for results in spawned_results(cp):
        kv_message = results["error/a2a_kv_heads"]
        assert kv_message is not None and f"cp={cp}" in kv_message and "1 KV heads" in kv_message
        assert f"{2 * cp} query heads" in kv_message and "allgather" in kv_message
        heads_message = results["error/a2a_heads"]
        assert heads_message is not None and f"{2 * cp + 1} query heads" in heads_message


def test_unknown_method_is_a_user_error():
    q = torch.randn(1, 4, 2, 4)
    with pytest.raises(UserError, match="unknown context-parallel attention method 'zigzag'.*allgather, ring, a2a"):
        context_parallel_attention(q, q, q, group=None, method="zigzag")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balance_indices_partition_the_sequence(cp):
    seq_len = 2 * cp * 3
    held = [load_balance_indices(seq_len, cp, rank) for rank in range(cp)]
    for indices in held:
        assert indices.dtype == torch.int64 and indices.shape == (seq_len // cp,)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq_len))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_rank_holds_chunks_i_and_mirror(cp):
    seq_len, chunk = 8 * cp, 4
    chunks = torch.arange(seq_len).split(chunk)
    for rank in range(cp):
        expected = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])
        assert torch.equal(load_balance_indices(seq_len, cp, rank), expected)


def test_shard_sequence_takes_the_load_balanced_rows():
    x = torch.randn(3, 16, 5)
    for rank in range(4):
        expected = x[:, load_balance_indices(16, 4, rank)]
        assert torch.equal(shard_sequence(x, 4, rank), expected)
    tokens = torch.arange(32).view(2, 16)
    assert torch.equal(shard_sequence(tokens, 2, 1), tokens[:, [4, 5, 6, 7, 8, 9, 10, 11]])
    seq_first = x.transpose(0, 1)
    assert torch.equal(shard_sequence(seq_first, 4, 2, dim=0), seq_first[load_balance_indices(16, 4, 2)])


def test_sequence_not_divisible_by_twice_cp_is_a_user_error():
    with pytest.raises(UserError, match="sequence length 12 is not divisible by 2 x cp = 8"):
        load_balance_indices(12, 4, 0)
    with pytest.raises(UserError, match="multiple of 4"):
        shard_sequence(torch.zeros(1, 6), 2, 0)


# ---------------------------------------------------------------------------------------------
# Ring block kernels, one process.


def _math_block(q, k, v, causal: bool):
    """fp64 reference of one block on [batch, seq, heads, head_dim] (GQA by adjacent head groups):
    out and lse [batch, heads, seq_q], differentiable."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v).transpose(1, 2), lse


def _block_inputs(seq_q: int, seq_k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, head_dim = 2, 4, 2, 8
    shapes = [(batch, seq_q, heads, head_dim), (batch, seq_k, kv_heads, head_dim), (batch, seq_k, kv_heads, head_dim)]
    q, k, v = (torch.randn(shape, generator=generator) for shape in shapes)
    return q, k, v, torch.randn(batch, seq_q, heads, head_dim, generator=generator)


def _close(actual, expected, name):
    error = ((actual.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= RTOL, f"{name}: relative error {error:.2e}"


CPU_KERNELS = ["flash_cpu", "math"]


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("causal,seq_q,seq_k", [(True, 12, 12), (False, 6, 12)], ids=["diagonal", "off_diagonal"])
def test_block_kernel_matches_math_attention(kernel, causal, seq_q, seq_k):
    q, k, v, grad = _block_inputs(seq_q, seq_k)
    out, lse, state = blocks.block_attention(kernel, q, k, v, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 4, seq_q) and lse.dtype == torch.float32
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected_out, expected_lse = _math_block(*full, causal)
    expected_out.backward(grad.double())
    _close(out, expected_out.detach(), "out")
    _close(lse, expected_lse.detach(), "lse")
    grads = blocks.block_attention_backward(kernel, grad, q, k, v, out, lse, causal, state)
    for name, actual, t in zip(("dq", "dk", "dv"), grads, full):
        assert actual.shape == t.shape, name
        _close(actual, t.grad, name)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_blocks_merged_by_lse_give_full_attention_and_exact_gradients(kernel):
    """Keys split in two blocks: merged outputs equal one block over all keys, and each block's
    backward from the merged out and lse gives its exact share of dq and its own dk, dv."""
    q, k, v, grad = _block_inputs(6, 12, seed=1)
    first, second = (slice(0, 5), slice(5, 12))
    out, lse, state = blocks.block_attention(kernel, q, k[:, first], v[:, first], False)
    out = out.float().contiguous()
    blocks.merge_into(out, lse, *blocks.block_attention(kernel, q, k[:, second], v[:, second], False)[:2])
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected_out, expected_lse = _math_block(*full, causal=False)
    expected_out.backward(grad.double())
    _close(out, expected_out.detach(), "out")
    _close(lse, expected_lse.detach(), "lse")
    grad_q = torch.zeros_like(q)
    for keys in (first, second):
        dq, dk, dv = blocks.block_attention_backward(kernel, grad, q, k[:, keys], v[:, keys], out, lse, False, state)
        grad_q += dq
        _close(dk, full[1].grad[:, keys], "dk")
        _close(dv, full[2].grad[:, keys], "dv")
    _close(grad_q, full[0].grad, "dq")


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_cuda_block_kernels_take_their_arguments(kernel):
    """The CUDA kernels' argument lists and result shapes, checked on meta tensors (no GPU needed)."""
    q, k, v, grad = (t.to("meta", torch.bfloat16) for t in _block_inputs(12, 12))
    out, lse, state = blocks.block_attention(kernel, q, k, v, True)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    grads = blocks.block_attention_backward(kernel, grad, q, k, v, out, lse, True, state)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_ring_block_kernel_choice():
    assert blocks.choose_block_kernel(torch.zeros(1, 4, 2, 8)) == "flash_cpu"
    assert blocks.choose_block_kernel(torch.zeros(1, 4, 2, 8, device="meta")) == "math"
    q = torch.zeros(1, 4, 2, 8)
    message = "unknown ring attention block kernel 'efficient'.*cudnn, flash, flash_cpu, math"
    with pytest.raises(ValueError, match=message):
        ring.ring_attention(q, q, q, None, kernel="efficient")


# ---------------------------------------------------------------------------------------------
# On 2 GPUs (NCCL): the ring in bf16 with each fused kernel forced, and every method with the
# automatic choice, against full fp32 attention.

GPU_CASES = {"gqa": cp_attention.Case(2, 2048, 8, 2, 128), "mha": cp_attention.Case(1, 1024, 4, 4, 64),
             # DeepSeek's head dims (128 + 64 rotary for q/k, 128 for v) and a YaRN-scaled softmax.
             "mla": cp_attention.Case(1, 2048, 8, 8, 192, v_head_dim=128, scale=0.135)}
GPU_RUNS = {  # name -> (method, ring kernel or None for the automatic choice, dtype, relative error bound)
    "cudnn": ("ring", "cudnn", torch.bfloat16, 2e-2),
    "flash": ("ring", "flash", torch.bfloat16, 2e-2),
    "auto_bf16": ("ring", None, torch.bfloat16, 2e-2),
    "auto_fp32": ("ring", None, torch.float32, 1e-4),
    "allgather_bf16": ("allgather", None, torch.bfloat16, 2e-2),
    "a2a_bf16": ("a2a", None, torch.bfloat16, 2e-2),
}


def _norm_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def _gpu_ring_worker(rank: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    group = dist.group.WORLD
    results: dict[str, dict] = {}
    try:
        for seed, (case, shape) in enumerate(GPU_CASES.items()):
            q, k, v, grad = cp_attention._random_inputs(shape, seed, device, torch.float32)
            for run, (method, kernel, dtype, _) in GPU_RUNS.items():
                if kernel is not None and shape.v_head_dim is not None:
                    continue  # values of their own head dim go through context_parallel_attention's choice
                # The reference is fp32 math attention of the same dtype-rounded inputs, on one GPU.
                full = [t.to(dtype).to(torch.float32, copy=True).requires_grad_() for t in (q, k, v)]
                with sdpa_kernel(SDPBackend.MATH):
                    reference = causal_attention(*full, scale=shape.scale)
                reference.backward(grad.to(dtype).float())
                expected = {"out": reference.detach(), "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
                local = [shard_sequence(t.to(dtype), 2, rank).requires_grad_() for t in (q, k, v)]
                if kernel is not None:
                    out = ring.ring_attention(*local, group, kernel=kernel, scale=shape.scale)
                else:
                    out = context_parallel_attention(*local, group=group, method=method, scale=shape.scale)
                out.backward(shard_sequence(grad.to(dtype), 2, rank))
                actual = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
                expected = {name: shard_sequence(t, 2, rank) for name, t in expected.items()}
                errors = {name: _norm_relative_error(actual[name], expected[name]) for name in expected}
                results[f"{case}/{run}"] = {"kernel": kernel or blocks.choose_block_kernel(local[0]), "errors": errors}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_context_parallel_on_two_gpus_in_bf16(tmp_path):
    mp.spawn(_gpu_ring_worker, args=(str(tmp_path),), nprocs=2, join=True)
    failures = []
    for rank in range(2):
        for name, result in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            run, kernel, errors = name.split("/")[1], result["kernel"], result["errors"]
            print(f"rank {rank} {name} ({kernel}): " + ", ".join(f"{key} {error:.2e}" for key, error in errors.items()))
            bound = GPU_RUNS[run][3]
            failures += [f"rank {rank} {name} {key} {e:.2e} > {bound}" for key, e in errors.items() if e > bound]
            if run == "auto_bf16" and kernel not in ("cudnn", "flash"):
                failures.append(f"bf16 on a GPU chose the {kernel} block kernel, not cuDNN or flash")
            if run == "auto_fp32" and kernel != "math":
                failures.append(f"fp32 on a GPU chose the {kernel} block kernel, not math")
    assert not failures, "; ".join(failures)
