"""Attention within documents and sliding windows: the mask (models/masking.py), its forms and kernels
(parallel/masked_attention.py) against the dense mask of one device, in one process. On CPU the
FlexAttention block masks run forward (flex has no CPU backward); `gpu`-marked tests run every kernel
forward and backward on a GPU."""

from __future__ import annotations

import pytest
import torch

from models import masking
from models.context import LocalContext
from models.errors import UserError
from parallel import masked_attention as masked
from parallel.attention_blocks import merge_into
from parallel.context_parallel import load_balance_indices
from tests.workers.cp_attention import document_ids_of


RTOL = 1e-5


CPU = torch.device("cpu")


def _close(actual, expected, name, rtol=RTOL):
    error = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert error <= rtol, f"{name}: relative error {error:.2e}"


def test_first_keys_follow_documents_and_window():
    ids = document_ids_of([[3, 1, 4]])
    assert masking.first_keys(ids).tolist() == [[0, 0, 0, 3, 4, 4, 4, 4]]
    assert masking.first_keys(ids, window=2).tolist() == [[0, 0, 1, 3, 4, 4, 5, 6]]
    # A document id that comes back after another is a new document, as the positions restart.
    assert masking.first_keys(torch.tensor([[0, 0, 1, 0]])).tolist() == [[0, 0, 2, 3]]
    assert masking.is_plain_causal(masking.first_keys(torch.zeros(2, 5, dtype=torch.int64), window=5))
    assert not masking.is_plain_causal(masking.first_keys(torch.zeros(2, 5, dtype=torch.int64), window=4))


def test_chunks_are_of_absolute_positions_within_documents():
    ids = document_ids_of([[3, 1, 4]])
    assert masking.first_keys(ids, chunk=3).tolist() == [[0, 0, 0, 3, 4, 4, 6, 6]]
    assert masking.first_keys(ids, window=2, chunk=3).tolist() == [[0, 0, 1, 3, 4, 4, 6, 6]]
    assert masking.is_plain_causal(masking.first_keys(torch.zeros(2, 5, dtype=torch.int64), chunk=5))
    # Segments between document and chunk starts are exactly what the chunked mask keeps.
    first = masking.first_keys(ids, chunk=3)
    segment = masking.segment_starts(ids, chunk=3).cumsum(1)
    positions = torch.arange(8)
    same_segment = (segment[:, :, None] == segment[:, None, :]) & (positions[None, :, None] >= positions)
    assert torch.equal(masking.allowed(first, positions, positions), same_segment)


def test_attended_pairs_count_the_kept_pairs():
    ids = document_ids_of([[5, 13, 1, 13], [20, 12]])
    for window in (None, 1, 6):
        first = masking.first_keys(ids, window)
        positions = torch.arange(32)
        assert masking.attended_pairs(first) == int(masking.allowed(first, positions, positions).sum())
    assert masking.attended_pairs(masking.first_keys(torch.zeros(3, 8, dtype=torch.int64))) == 3 * 8 * 9 // 2


def test_local_context_leaves_plain_causal_masks_to_the_fused_kernel():
    ctx = LocalContext()
    assert ctx.attention_mask(torch.zeros(2, 16, dtype=torch.int64)) is None
    assert ctx.attention_mask(torch.zeros(2, 16, dtype=torch.int64), window=16) is None
    assert ctx.attention_mask(torch.zeros(2, 16, dtype=torch.int64), window=15) is not None


SITES = {  # name -> (query positions, key positions) of seq 64: a whole row, a cp rank's chunks, ring blocks
    "whole_row": (torch.arange(64), torch.arange(64)),
    "cp2_rank0_gathered": (load_balance_indices(64, 2, 0), torch.arange(64)),
    "cp2_rank1_gathered": (load_balance_indices(64, 2, 1), torch.arange(64)),
    "cp4_rank1_late_block": (load_balance_indices(64, 4, 1)[8:], load_balance_indices(64, 4, 3)),
}


MASKS = {  # name -> (document lengths per row, window, chunk)
    "documents": ([[5, 13, 1, 13, 20, 12], [64]], None, None), "window": ([[64], [64]], 7, None),
    "both": ([[30, 2, 32], [10, 54]], 9, None), "chunks": ([[30, 2, 32], [64]], None, 12),
}


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("mask", MASKS)
def test_block_classes_bound_the_dense_mask(site, mask):
    """With blocks of 4 tokens: a block any key of which a query sees is never skipped, and a block
    taken whole is allowed everywhere; for runs of consecutive positions both are exact."""
    lengths, window, chunk = MASKS[mask]
    first = masking.first_keys(document_ids_of(lengths), window, chunk)
    q_positions, k_positions = SITES[site]
    some, full = masked._block_classes(first, q_positions, k_positions, block=4)
    dense = masking.allowed(first, q_positions, k_positions).unflatten(1, (-1, 4)).unflatten(3, (-1, 4))
    any_allowed, all_allowed = dense.any(dim=(2, 4)), dense.all(dim=(2, 4))
    assert torch.equal(some, any_allowed)  # every site above is made of runs of >= 4 consecutive positions
    assert torch.equal(full, all_allowed)
    assert some.sum() < some.numel()  # the mask skips blocks


@pytest.mark.parametrize("site", ["whole_row", "cp2_rank1_gathered"])
@pytest.mark.parametrize("mask", MASKS)
def test_flex_block_mask_matches_dense_forward_on_cpu(site, mask):
    """The FlexAttention form (block lists of 128-token blocks and the element-wise mask_mod) gives
    the dense mask's output; sequence 512 so that blocks are skipped, taken whole and masked."""
    lengths, window, chunk = MASKS[mask]
    ids = document_ids_of(lengths).repeat_interleave(8, dim=1)  # documents 8 times longer
    q_positions, k_positions = (p.reshape(-1, 1).mul(8).add(torch.arange(8)).flatten() for p in SITES[site])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, len(q_positions), 4, 16, generator=generator)
    k, v = (torch.randn(2, len(k_positions), 2, 16, generator=generator) for _ in range(2))
    first = masking.first_keys(ids, window, chunk and chunk * 8)
    flex_form = masked.build_form("flex", ids, first, q_positions, k_positions, window, CPU)
    dense_form = masked.build_form("dense", ids, first, q_positions, k_positions, window, CPU)
    assert flex_form.block_mask.kv_num_blocks.shape == (2, 1, len(q_positions) // 128)
    _close(masked.attend(q, k, v, flex_form), masked.attend(q, k, v, dense_form), "out")


def test_masked_ring_blocks_merge_to_the_whole_attention():
    """As a ring step does: queries 8..23 against their own keys first (every query sees itself),
    then keys 0..7, which many queries see nothing of (their block lse is -inf). Merged by
    log-sum-exp they give dense attention, and each block's backward from the merged out and lse
    its exact share of dq and its own dk, dv."""
    ids = document_ids_of([[6, 10, 8], [24]])
    first = masking.first_keys(ids, window=5)
    positions, queries = torch.arange(24), torch.arange(8, 24)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 16, 4, 8, generator=generator)
    k, v = (torch.randn(2, 24, 2, 8, generator=generator) for _ in range(2))
    grad = torch.randn(2, 16, 4, 8, generator=generator)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked.attend(*full, masked.build_form("dense", ids, first, queries, positions, 5, CPU))
    expected.backward(grad)

    key_blocks = [slice(8, 24), slice(0, 8)]
    forms = [masked.build_form("dense", ids, first, queries, positions[keys], 5, CPU) for keys in key_blocks]
    out, lse = masked.block_forward(q, k[:, 8:], v[:, 8:], forms[0])
    out = out.float().contiguous()
    block_out, block_lse = masked.block_forward(q, k[:, :8], v[:, :8], forms[1])
    assert torch.isinf(block_lse).any() and not block_out.isnan().any()
    merge_into(out, lse, block_out, block_lse)
    _close(out, expected.detach(), "out")
    grad_q = torch.zeros_like(q)
    for keys, form in zip(key_blocks, forms):
        dq, dk, dv = masked.block_backward(grad, q, k[:, keys], v[:, keys], out, lse, form)
        grad_q += dq
        _close(dk, full[1].grad[:, keys], "dk")
        _close(dv, full[2].grad[:, keys], "dv")
    _close(grad_q, full[0].grad, "dq")


def test_kernel_rule():
    cuda = "cuda"
    assert masked.choose_kernel("auto", "cpu", torch.bfloat16, True, False) == "dense"
    assert masked.choose_kernel("flex", "cpu", torch.bfloat16, True, False) == "dense"
    varlen = "varlen" if masked.varlen_available(False) else "flex"
    assert masked.choose_kernel("auto", cuda, torch.bfloat16, True, False) == varlen
    assert masked.choose_kernel("auto", cuda, torch.bfloat16, False, False) == "flex"  # cp chunks
    assert masked.choose_kernel("varlen", cuda, torch.bfloat16, False, False) == "flex"
    assert masked.choose_kernel("auto", cuda, torch.float32, True, False) == "flex"
    assert masked.choose_kernel("flex", cuda, torch.bfloat16, True, False) == "flex"
    assert masked.choose_kernel("dense", cuda, torch.bfloat16, True, False) == "dense"
    with pytest.raises(UserError, match="unknown --attention-kernel 'xformers'"):
        masked.choose_kernel("xformers", cuda, torch.bfloat16, True, False)


def test_segment_offsets_span_the_flattened_batch():
    ids = document_ids_of([[3, 1, 4], [8]])
    offsets, longest = masked._segment_offsets(masking.segment_starts(ids))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 4, 8, 16] and longest == 8
    # Chunks of 3 absolute positions cut the documents again: each piece is causal on its own.
    offsets, longest = masked._segment_offsets(masking.segment_starts(ids, chunk=3))
    assert offsets.tolist() == [0, 3, 4, 6, 8, 11, 14, 16] and longest == 3


@pytest.mark.skipif(masked._torch_varlen()[0] is None or masked.flash_attn_varlen() is not None,
                    reason="torch's varlen_attn is not the one used")
def test_varlen_call_fits_this_torch():
    """torch's varlen_attn called as dtrain calls it (keywords by its signature), on meta tensors."""
    ids = document_ids_of([[3, 9, 4], [16]])
    form = masked.build_form("varlen", ids, masking.first_keys(ids, 4), torch.arange(16), torch.arange(16), 4, CPU)
    q = torch.empty(2, 16, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 16, 2, 64, device="meta", dtype=torch.bfloat16)
    form = masked.MaskForm("varlen", False, cu_seqlens=form.cu_seqlens.to("meta"), max_seqlen=form.max_seqlen,
                           window=4)
    assert masked.attend(q, k, k, form).shape == q.shape
    # MLA: values of a smaller head dim (padded for the kernel, cut back after) and a scale of its own.
    v = torch.empty(2, 16, 2, 48, device="meta", dtype=torch.bfloat16)
    assert masked.attend(q, k, v, form, scale=0.1).shape == (2, 16, 8, 48)


@pytest.mark.gpu
def test_gpu_flex_ring_blocks_merge_to_the_whole_attention():
    """The flex ring block's backward (recomputed, pulled back through the merge) in bf16 on a GPU,
    as a ring step runs it: queries 1024..2047 against their own keys, then keys 0..1023."""
    cuda = torch.device("cuda")
    ids = document_ids_of([[600, 900, 548], [2048]])
    first = masking.first_keys(ids, 700)
    positions, queries = torch.arange(2048), torch.arange(1024, 2048)
    generator = torch.Generator().manual_seed(3)
    q, grad = (torch.randn(2, 1024, 8, 64, generator=generator).to(cuda, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2048, 2, 64, generator=generator).to(cuda, torch.bfloat16) for _ in range(2))
    full = [t.float().requires_grad_() for t in (q, k, v)]
    expected = masked.attend(*full, masked.build_form("dense", ids, first, queries, positions, 700, cuda))
    expected.backward(grad.float())
    key_blocks = [slice(1024, 2048), slice(0, 1024)]
    forms = [masked.build_form("flex", ids, first, queries, positions[keys], 700, cuda) for keys in key_blocks]
    out, lse = masked.block_forward(q, k[:, 1024:], v[:, 1024:], forms[0])
    out = out.float().contiguous()
    merge_into(out, lse, *masked.block_forward(q, k[:, :1024], v[:, :1024], forms[1]))
    grad_q = torch.zeros_like(q, dtype=torch.float32)
    grad_k, grad_v = (torch.zeros_like(t, dtype=torch.float32) for t in (k, v))
    for keys, form in zip(key_blocks, forms):
        dq, dk, dv = masked.block_backward(grad, q, k[:, keys], v[:, keys], out.to(q.dtype), lse, form)
        grad_q += dq
        grad_k[:, keys] += dk
        grad_v[:, keys] += dv
    for name, a, e in [("out", out, expected), ("dq", grad_q, full[0].grad), ("dk", grad_k, full[1].grad),
                       ("dv", grad_v, full[2].grad)]:
        error = ((a.float() - e).norm() / e.norm()).item()
        assert error < 2e-2, f"{name}: {error:.2e}"
