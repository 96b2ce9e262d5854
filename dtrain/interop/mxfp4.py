"""MXFP4 weights (the OCP microscaling format gpt-oss publishes its experts in), dequantized.

A tensor of [..., out, in] is stored as `blocks` uint8 [..., out, in / 32, 16] and `scales` uint8
[..., out, in / 32]: each block of 32 consecutive values holds 32 e2m1 codes, two per byte (the low
nibble first), and one shared exponent 2^(scale - 127). A code's low three bits index
{0, 0.5, 1, 1.5, 2, 3, 4, 6}, its fourth is the sign."""

from __future__ import annotations

import torch

from models.errors import UserError

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
EXPONENT_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
               name: str = "MXFP4 blocks") -> torch.Tensor:
    """[..., out, in] in `dtype` from MXFP4 `blocks` [..., out, in / 32, 16] and `scales`
    [..., out, in / 32]; `name` (the tensor and its file) is what an error names. The products are
    exact in bf16 (a code has two significant bits)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise UserError(f"{name}: MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}: the "
                        f"checkpoint is not the MXFP4 layout its config.json names")
    if blocks.dim() < 3 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise UserError(f"{name}: MXFP4 blocks of shape {list(blocks.shape)} do not fit scales of shape "
                        f"{list(scales.shape)} (blocks [..., out, n, 16] for scales [..., out, n]); the checkpoint "
                        f"is damaged")
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., n, 32], low nibble first
    exponents = scales.to(torch.int32)[..., None] - EXPONENT_BIAS
    return torch.ldexp(table[codes], exponents).to(dtype).flatten(-2)
