"""Context parallelism's pieces in one process: the load-balanced split of a sequence (each rank
holds chunk i and its mirror), the one-line errors for an unknown method or a sequence that does
not divide, and the ring's block kernels (out + log-sum-exp forward, backward from the merged out
and lse) one block at a time against math attention. Every method on spawned ranks against full
attention: tests/integration/test_context_parallel_attention.py."""

from __future__ import annotations

import pytest
import torch

from models.errors import UserError
from parallel import attention_blocks as blocks
from parallel import ring_attention as ring
from parallel.context_parallel import context_parallel_attention, load_balance_indices, shard_sequence


RTOL = 1e-5


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
