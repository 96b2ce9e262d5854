"""The routed experts' grouped GEMMs in FP8 with dynamic rowwise scaling (`--fp8-experts` with the
torchao backend), as a drop-in for the bf16 experts: the same SwiGLU (biases and gpt-oss's clamped
unit included) between three grouped GEMMs whose operands are cast to float8 e4m3 on the fly.

    rows sorted by expert -> each expert's rows moved to a start that is a multiple of 16 (the
    FP8 grouped GEMM's group alignment), zero rows between -> gate, up, down as FP8 grouped GEMMs
    (torchao's `_to_fp8_rowwise_then_scaled_grouped_mm`: Triton casts and torch._scaled_grouped_mm)
    -> each row's output gathered back

Nothing is read on the host: the aligned layout has a fixed number of rows for a given row count
(room for every expert's padding) and its positions and group offsets are computed from the
counts on the device. Rows past the counted ones (an all-gather dispatch's slots of other ranks'
experts, slots over capacity) fall after the last group; their outputs are unspecified, and the
callers mask them.

The scaling (torchao's recipe, scales rounded down to powers of two): each operand is scaled
along the dim its GEMM sums over. Forward: the rows per row, each expert's weight per output
column. Input gradient: the output gradient per row, the weight per input column. Weight
gradient: the output gradient and the input per column within each expert's rows. So no cast of
the forward serves a GEMM of the backward: every GEMM casts its operands (one memory-bound pass
each), and nothing is cached across micro-batches.

Where no FP8 grouped GEMM runs (CPUs, fake tensors of a dry run, GPUs before compute capability
8.9) the same casts are emulated: each operand is rounded to float8 with its scales and back,
then multiplied by torch's grouped GEMM, which gives the FP8 GEMMs' products up to accumulation
order (tests/unit/test_fp8_experts.py; tests/unit/test_moe_gpu.py compares the two on a GPU).
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.nn.functional as F

from models.config import ClampedSwiGLU
from models.context import ExpertBiases, grouped_swiglu
from models.errors import UserError

# Rows per group that torch._scaled_grouped_mm needs (16 bytes of float8 along the summed dim of
# the weight gradient's GEMM).
ALIGN = 16
FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max
EPS = 1e-12  # the smallest amax a scale is taken from (torchao's)


def padded_rows(rows: int, experts: int, align: int = ALIGN) -> int:
    """The rows of the aligned layout: room for every expert's padding, a multiple of `align`."""
    return -(-(rows + experts * (align - 1)) // align) * align


class AlignedRows:
    """Rows sorted by expert (`counts` each, possibly followed by uncounted rows) moved so that
    each expert's group starts at a multiple of `align`; every group is padded to a multiple of
    `align` with zero rows. Positions and offsets are device tensors."""

    def __init__(self, counts: torch.Tensor, rows: int, align: int = ALIGN):
        self.rows = padded_rows(rows, counts.numel(), align)
        counts = counts.to(torch.int64)
        self.counts = (counts + align - 1) // align * align
        padding = self.counts - counts
        # The padding before each expert's group, and after all of them for uncounted rows.
        shift = F.pad(torch.cumsum(padding, 0), (1, 0))
        row = torch.arange(rows, device=counts.device)
        expert_of_row = torch.searchsorted(torch.cumsum(counts, 0), row, right=True)
        self.positions = row + shift[expert_of_row]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(self.rows, x.shape[1]).index_copy(0, self.positions, x)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[self.positions]


def _pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """float8's largest value over the amax, rounded down to a power of two (exact to undo)."""
    return torch.exp2(torch.floor(torch.log2(FLOAT8_MAX / amax.float().clamp_min(EPS))))


def _through_float8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`t` scaled, cast to float8 (saturated) and scaled back, in t's dtype (exact there: float8's
    3 mantissa bits times a power of two fit bf16)."""
    return ((t.float() * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8).float() / scale).to(t.dtype)


def _rounded_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` through float8 with one scale per slice along `dim` (the dim a GEMM sums over)."""
    return _through_float8(t, _pow2_scales(t.abs().amax(dim, keepdim=True)))


def _rounded_per_group(t: torch.Tensor, group_of_row: torch.Tensor, groups: int) -> torch.Tensor:
    """`t` [rows, cols] through float8 with one scale per column within each group of rows
    (`group_of_row` in 0 .. groups, `groups` for rows in no group)."""
    index = group_of_row[:, None].expand_as(t)
    amax = t.new_zeros(groups + 1, t.shape[1], dtype=torch.float32).scatter_reduce(
        0, index, t.abs().float(), "amax")
    return _through_float8(t, _pow2_scales(amax)[group_of_row])


class _EmulatedRowwiseGroupedMM(torch.autograd.Function):
    """x @ w[e].T for each group of rows, with the FP8 rowwise recipe's casts emulated."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        group_of_row = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device, dtype=offs.dtype),
                                          right=True)
        ctx.save_for_backward(x, w, offs, group_of_row)
        return F.grouped_mm(_rounded_along(x, -1), _rounded_along(w, -1).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offs, group_of_row = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = F.grouped_mm(_rounded_along(grad, -1), _rounded_along(w, -2), offs=offs)
        grad_w = F.grouped_mm(_rounded_per_group(grad, group_of_row, w.shape[0]).t(),
                              _rounded_per_group(x, group_of_row, w.shape[0]), offs=offs)
        return grad_x, grad_w, None


@functools.cache
def _torchao_grouped_mm():
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError as error:
        import torchao

        raise UserError(f"--fp8-experts runs torchao's FP8 rowwise grouped GEMM, which torchao "
                        f"{torchao.__version__} lacks ({error}); install torchao >= 0.18") from None
    return _to_fp8_rowwise_then_scaled_grouped_mm


@attrs.frozen
class Fp8GroupedExperts:
    """`ModelContext.experts` on local tensors with FP8 grouped GEMMs (`native`: torchao's
    kernels, else their emulation). `first` (the global id of the rank's first expert) is taken
    for the experts op's signature: dynamic scaling keeps no state per expert."""

    native: bool

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, first: int = 0, *, biases: ExpertBiases | None = None,
                 glu: ClampedSwiGLU | None = None) -> torch.Tensor:
        layout = AlignedRows(counts, x.shape[0])
        out = grouped_swiglu(layout.pad(x), layout.counts, w_gate, w_up, w_down, biases=biases, glu=glu,
                             mm=self.grouped_mm)
        return layout.unpad(out)

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x @ w[e].T for each group of rows (w [experts, out, in]; `offs` the groups' ends)."""
        if self.native:
            return _torchao_grouped_mm()(x, w.transpose(-2, -1), offs, x.dtype, FLOAT8, False)
        return _EmulatedRowwiseGroupedMM.apply(x, w, offs)


def check_shapes(dim: int, expert_ffn_dim: int) -> None:
    """FP8 GEMMs need the dims they multiply over to be multiples of 16."""
    odd = sorted({d for d in (dim, expert_ffn_dim) if d % 16})
    if odd:
        raise UserError(f"--fp8-experts needs the experts' dims (dim {dim}, expert_ffn_dim {expert_ffn_dim}) to be "
                        f"multiples of 16; {odd} are not: change the model shape or drop --fp8-experts")
