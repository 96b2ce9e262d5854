"""FP8 matmuls through torchao: emulated on CPU (the same casts, high-precision GEMMs), native
FP8 GEMMs on Hopper GPUs (marked gpu)."""

import pytest
import torch

from parallel.precision import Float8Linear
from tests.launch import train_scalars


BF16 = ["--precision", "bf16", "--steps", "5"]  # emulated FP8 steps are slow on CPU


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    return train_scalars(tmp_path_factory.mktemp("bf16"), BF16)["train/loss"]


_FP8_BLOCK_LOSSES: dict[str, list[float]] = {}


@pytest.mark.slow
@pytest.mark.parametrize("mesh,head", [("", False), ("tp=2", False), ("", True), ("tp=2", True)])
def test_fp8_tracks_bf16_loss(tmp_path, bf16_losses, mesh, head):
    """FP8 in the blocks, then in the output head too, alone and with tensor parallelism (DTensor
    weights in the FP8 matmuls; the head's weight split over the vocabulary)."""
    bf16 = bf16_losses
    nproc = 2 if mesh else 1
    blocks_only = [*BF16, "--fp8", "tensorwise", "--mesh", mesh]
    fp8 = train_scalars(tmp_path, [*blocks_only, *(["--fp8-head"] if head else [])], nproc=nproc)["train/loss"]
    assert fp8 != bf16, "the FP8 run computed exactly the bf16 losses: FP8 was not used"
    if head:
        if mesh not in _FP8_BLOCK_LOSSES:
            _FP8_BLOCK_LOSSES[mesh] = train_scalars(tmp_path / "blocks", blocks_only, nproc=nproc)["train/loss"]
        assert fp8 != _FP8_BLOCK_LOSSES[mesh], "--fp8-head changed no loss: the head stayed in bf16"
    else:
        _FP8_BLOCK_LOSSES[mesh] = fp8
    assert len(fp8) == len(bf16) == 5
    for step, (a, e) in enumerate(zip(fp8, bf16), 1):
        assert abs(a - e) <= 0.05 * e, f"step {step}: fp8 loss {a} vs bf16 {e}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_linear_matches_matmul_within_fp8_error(recipe):
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    out = Float8Linear(recipe, emulate=True)(x, w)
    reference = x @ w.t()
    # e4m3 keeps 3 mantissa bits: a few percent of relative error, never exact.
    relative = (out - reference).norm() / reference.norm()
    assert 1e-4 < relative.item() < 0.1, relative
    out.backward(torch.ones_like(out))
    assert x.grad is not None and w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.gpu
def test_fp8_step_on_gpu_is_close_to_bf16():
    torch.manual_seed(0)
    x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    out = Float8Linear("tensorwise", emulate=False)(x, w)
    reference = x @ w.t()
    assert ((out.float() - reference.float()).norm() / reference.float().norm()).item() < 0.05
