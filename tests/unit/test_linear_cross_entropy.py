"""The chunked output projection and cross-entropy (--loss-chunk-tokens) in one process: loss and
gradients equal to the unfused path's (fp32, 1e-6 relative) for chunks that divide the tokens and
chunks that do not, the bf16 gradients scaled in fp32, no gradient work where no backward comes,
and a head whose peak memory stays below one micro-batch of fp32 logits. Compiled, with MTP and
in training runs: tests/integration/test_linear_cross_entropy.py."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models import linear_cross_entropy
from models.context import LocalContext


RTOL = 1e-6


TOKENS = (2, 37)  # 74 tokens


def _case(dtype=torch.float32, vocab: int = 300, dim: int = 32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(*TOKENS, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator) * 0.3
    labels = torch.randint(0, vocab, TOKENS, generator=generator)
    labels[0, :5] = -100  # a whole chunk of ignored labels when chunks are small
    labels[1, -3:] = -100
    return h.to(dtype), weight.to(dtype), labels


def _context(chunk: int) -> LocalContext:
    ctx = LocalContext()
    ctx.loss_chunk_tokens = chunk
    return ctx


def _loss_and_gradients(h, weight, labels, chunk: int):
    """The loss, and the gradients of h and the weight of loss / 71 (a gradient other than 1)."""
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = _context(chunk).output_cross_entropy_sum(h, weight, labels)
    return (loss.detach(), *torch.autograd.grad(loss / 71, (h, weight)))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("chunk", [1, 7, 48, 74, 1000])
def test_chunked_loss_and_gradients_equal_the_unfused(chunk):
    h, weight, labels = _case()
    unfused = _loss_and_gradients(h, weight, labels, 0)
    chunked = _loss_and_gradients(h, weight, labels, chunk)
    for name, actual, expected in zip(("loss", "d h", "d weight"), chunked, unfused):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        assert _relative(actual, expected) <= RTOL, (name, _relative(actual, expected))


def test_the_loss_gradient_scales_the_bf16_gradients_in_fp32():
    """The gradients of s * loss are s times those of the loss up to one more bf16 rounding of each
    (0.20% and 0.26% of the norm here), not off by the 0.39% of s = 1 + 2^-8 rounded to bf16."""
    h, weight, labels = _case(torch.bfloat16, vocab=512, dim=64)
    scale = 1 + 2**-8

    def gradients(factor: float):
        h_, weight_ = h.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = _context(7).output_cross_entropy_sum(h_, weight_, labels)
        return torch.autograd.grad(loss * factor, (h_, weight_))

    for scaled, plain in zip(gradients(scale), gradients(1.0)):
        assert _relative(scaled, plain.double() * scale) <= 0.0032


def test_without_a_backward_no_gradients_are_made(monkeypatch):
    h, weight, labels = _case()
    expected = _loss_and_gradients(h, weight, labels, 0)[0]

    def refuse(*args):
        raise AssertionError("the autograd function (gradients made in the forward) ran without a backward")

    monkeypatch.setattr(linear_cross_entropy.LinearCrossEntropySum, "apply", refuse)
    weight.requires_grad_()
    with torch.no_grad():
        loss = _context(7).output_cross_entropy_sum(h, weight, labels)
    assert _relative(loss, expected) <= RTOL


class PeakLiveBytes(TorchDispatchMode):
    """The largest sum of the sizes of the storages that ops made and that were still alive."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.sizes:
                storage = tensor.untyped_storage()
                self.sizes[storage.data_ptr()] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.data_ptr())
        return out

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)


def test_peak_memory_of_the_head_stays_below_one_micro_batch_of_logits():
    tokens, dim, vocab = 1024, 64, 16384
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator) * 0.1
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    logits_bytes = tokens * vocab * 4
    peaks = {}
    for chunk in (0, 128):
        h_, weight_ = h.clone().requires_grad_(), weight.clone().requires_grad_()
        with PeakLiveBytes() as tracker:
            _context(chunk).output_cross_entropy_sum(h_, weight_, labels).backward()
        peaks[chunk] = tracker.peak
    # Unfused: the fp32 logits and their gradient at least. Chunked: 8 chunks' worth of logits at
    # most (its own fp32 weight gradient and a few chunks of logits).
    assert peaks[0] >= 2 * logits_bytes, peaks
    assert peaks[128] <= logits_bytes, peaks
