"""Indexed data through the trainer: a preprocessed corpus trains with validation passes and
document masking, and the masks and positions reach attention as they should."""

import pytest
import torch

from models.context import LocalContext
from models.layers import apply_rope, rope_frequencies, rope_table


@pytest.mark.parametrize("window", [None, 3])
def test_document_mask_equals_attention_per_document(window):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 12, 4, 8), torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
    boundaries = [0, 5, 9, 12]
    document_ids = torch.tensor([[i for i in range(3) for _ in range(boundaries[i + 1] - boundaries[i])]])
    ctx = LocalContext()
    masked = ctx.attention(q, k, v, ctx.attention_mask(document_ids, window))
    for start, end in zip(boundaries, boundaries[1:]):
        # Each document alone, with the window as an explicit band of keys.
        alone_ids = torch.zeros(1, end - start, dtype=torch.int64)
        alone_mask = ctx.attention_mask(alone_ids, window) if window is not None else None
        alone = ctx.attention(q[:, start:end], k[:, start:end], v[:, start:end], alone_mask)
        if window is not None:
            band = [[0 <= p - j < window for j in range(end - start)] for p in range(end - start)]
            explicit = torch.nn.functional.scaled_dot_product_attention(
                *(t[:, start:end].transpose(1, 2) for t in (q, k, v)), attn_mask=torch.tensor(band),
                enable_gqa=True).transpose(1, 2)
            torch.testing.assert_close(alone, explicit, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(masked[:, start:end], alone, rtol=1e-5, atol=1e-6)


def test_per_sample_positions_rotate_like_shared_positions():
    inv_freq = rope_frequencies(8, 10000.0, None)
    x = torch.randn(2, 6, 3, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    rotated = apply_rope(x, *rope_table(positions, inv_freq))
    shared = apply_rope(x, *rope_table(torch.arange(6), inv_freq))
    torch.testing.assert_close(rotated[1], shared[1])            # sample 1 counts straight through
    torch.testing.assert_close(rotated[0, 3:], apply_rope(x[:, 3:], *rope_table(torch.arange(3), inv_freq))[0])
