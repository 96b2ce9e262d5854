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
from parallel import attention_blocks as blocks
from parallel import ring_attention as ring
from parallel.context_parallel import CP_METHODS, context_parallel_attention, shard_sequence
from tests.workers import cp_attention
from tests.unit.test_context_parallel_attention import RTOL


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
