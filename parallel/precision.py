"""Precision backends behind the model context's `linear`: the plain matmul in the compute dtype
(bf16 or fp32), or FP8 through torchao (tensorwise, rowwise, rowwise_with_gw_hp) or Transformer
Engine. torchao and Transformer Engine are imported only when chosen."""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from models.errors import UserError

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FP8_BACKENDS = ("torchao", "te")


def validate_fp8(recipe: str | None, backend: str, dims: list[int]) -> None:
    """Before any memory: the recipe and backend exist, and every matmul dim FP8 sees is a
    multiple of 16 (the FP8 GEMM's requirement)."""
    if recipe is None:
        return
    if recipe not in FP8_RECIPES:
        raise UserError(f"unknown --fp8 {recipe!r}; choose one of {', '.join(FP8_RECIPES)}")
    if backend not in FP8_BACKENDS:
        raise UserError(f"unknown --fp8-backend {backend!r}; choose one of {', '.join(FP8_BACKENDS)}")
    if backend == "te":
        if importlib.util.find_spec("transformer_engine") is None:
            raise UserError("--fp8-backend te needs Transformer Engine (pip install 'dtrain[te]'); "
                            "or use --fp8-backend torchao")
        raise UserError("--fp8-backend te: Transformer Engine layers keep their own tensor-parallel groups "
                        "outside DTensor and are not wired into dtrain yet; use --fp8-backend torchao")
    odd = sorted({d for d in dims if d % 16})
    if odd:
        raise UserError(f"--fp8 needs every matmul dim to be a multiple of 16, but the model has {odd}; "
                        f"change the model shape or drop --fp8")


class Float8Linear:
    """x @ w.T with dynamic FP8 scaling (torchao): inputs, weights and output gradients are cast
    to float8 per the recipe, the GEMMs run in FP8 with high-precision accumulation. `emulate`
    runs the same casts with high-precision matmuls, for machines without FP8 GEMMs (the CPU)."""

    def __init__(self, recipe: str, emulate: bool):
        from torchao.float8 import Float8LinearConfig, LinearMMConfig, ScaledMMConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        self.config = config
        self.mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim)
                                          for g in gemms))
        self._matmul = matmul_with_hp_or_float8_args

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._matmul.apply(x, weight.t(), self.mm_config, self.config)


def fp8_linear(recipe: str | None, device: torch.device) -> Float8Linear | None:
    if recipe is None:
        return None
    # FP8 GEMMs need Hopper-class GPUs (compute capability 8.9+); elsewhere the casts are emulated.
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return Float8Linear(recipe, emulate=not native)
