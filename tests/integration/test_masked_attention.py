"""Attention within documents and sliding windows: the mask (models/masking.py), its forms and kernels
(parallel/masked_attention.py) against the dense mask of one device, in one process. On CPU the
FlexAttention block masks run forward (flex has no CPU backward); `gpu`-marked tests run every kernel
forward and backward on a GPU."""

from __future__ import annotations

import pytest
import torch

from models import masking
from parallel import masked_attention as masked
from tests.workers.cp_attention import document_ids_of
from tests.unit.test_masked_attention import MASKS


# q/k heads and head dim, v heads and head dim, softmax scale: GQA, and MLA's head dims and scale.
HEADS = {"gqa": (8, 128, 2, 128, None), "mla": (8, 192, 8, 128, 0.135)}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flex", "varlen"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("heads", HEADS)
def test_gpu_kernels_match_dense_attention(kernel, mask, heads):
    if kernel == "varlen" and not masked.varlen_available(MASKS[mask][1] is not None):
        pytest.skip("no variable-length attention with a window in this torch")
    num_heads, qk_dim, kv_heads, v_dim, scale = HEADS[heads]
    cuda = torch.device("cuda")
    lengths, window, chunk = MASKS[mask]
    ids = document_ids_of(lengths).repeat_interleave(32, dim=1)  # seq 2048
    window, chunk = window and window * 32, chunk and chunk * 32
    first = masking.first_keys(ids, window, chunk)
    positions = torch.arange(ids.shape[1])
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2048, num_heads, qk_dim, generator=generator).to(cuda)
    grad = torch.randn(2, 2048, num_heads, v_dim, generator=generator).to(cuda)
    k = torch.randn(2, 2048, kv_heads, qk_dim, generator=generator).to(cuda)
    v = torch.randn(2, 2048, kv_heads, v_dim, generator=generator).to(cuda)
    inputs = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    reference = [t.detach().float().requires_grad_() for t in inputs]
    out = masked.attend(*inputs, masked.build_form(kernel, ids, first, positions, positions, window, cuda,
                                                   chunk=chunk), scale)
    expected = masked.attend(*reference, masked.build_form("dense", ids, first, positions, positions, window, cuda),
                             scale)
    out.backward(grad.to(torch.bfloat16))
    expected.backward(grad)
    for name, a, e in [("out", out, expected), *zip(("dq", "dk", "dv"), (t.grad for t in inputs),
                                                    (t.grad for t in reference))]:
        error = ((a.float() - e).norm() / e.norm()).item()
        assert error < 2e-2, f"{kernel} {mask} {heads} {name}: {error:.2e}"
