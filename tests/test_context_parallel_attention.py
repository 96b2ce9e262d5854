"""dtrain's context-parallel attention (allgather, ring, a2a) against full causal attention of the
unsplit sequence: output and dq/dk/dv on every rank, fp32 on CPU with gloo, relative error <= 1e-5.
One spawned process group per cp size runs every case (tests/workers/cp_attention.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from models.errors import UserError
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
    for name, (_, _, heads, kv_heads, _) in cp_attention.CASES.items():
        for method in CP_METHODS:
            if method != "a2a" or (heads % cp == 0 and kv_heads % cp == 0):
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
