"""A stand-in for Transformer Engine on machines without CUDA (TE's PyTorch extension builds only
with CUDA): the modules and names that parallel/te_linear.py and parallel/te_experts.py use
(the grouped GEMM and the bulk casts as one call per group), computing what TE computes
for per-tensor recipes (a cast to torch's float8 dtypes with the quantizer's scale, the GEMM in
fp32 on the dequantized values) and recording every call, so that CPU tests check dtrain's wiring:
which local tensors reach TE, with which scales and usages, and what comes back.

    with fake_te.installed() as calls:     # in this process
        ...
    python -m tests.workers.with_fake_te ...   # in torchrun workers (FAKE_TE_LOG=FILE: calls as JSON)

The GEMM checks the usages TE's cuBLAS GEMM needs (row-wise data for a transposed operand of a TN
layout, column-wise for the others), so a missing `set_usage` fails here as it would on a GPU.
The block recipes (mxfp8, blockwise) are emulated per tensor; `is_mxfp8_available` answers as a
Hopper GPU does.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field

import torch

CALLS: list[dict] = []


class DType(enum.IntEnum):
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


TORCH_DTYPES = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}


@dataclass
class MMParams:
    use_split_accumulator: bool = True


@dataclass
class DelayedScaling:
    margin: int = 0
    amax_history_len: int = 1024


@dataclass
class Float8CurrentScaling:
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: MMParams(False))
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)


@dataclass
class MXFP8BlockScaling:
    margin: int = 0


@dataclass
class Float8BlockScaling:
    fp8_gemm_fprop: MMParams = field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)


@dataclass
class QuantizerRole:
    module_type: str = ""
    tensor_type: str = ""


@dataclass
class Quantized:
    """What a quantizer returns: the dequantized values, and which layouts were made."""

    values: torch.Tensor
    rowwise: bool
    columnwise: bool


class _Quantizer:
    def __init__(self, dtype: DType, per_tensor: bool = True):
        self.dtype = DType(dtype)
        self.per_tensor = per_tensor
        self.rowwise_usage = self.columnwise_usage = True
        self.internal = self.optimize_for_gemm = False

    def set_usage(self, *, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def __call__(self, tensor: torch.Tensor) -> Quantized:
        assert self.internal, "dtrain asks for storage objects (internal quantizers)"
        assert tensor.dtype in (torch.bfloat16, torch.float32), tensor.dtype
        if self.per_tensor and self.columnwise_usage and not self.rowwise_usage:
            # As TE 2.20 on a Hopper GPU: its per-tensor cast writes the transpose beside the rows.
            raise NotImplementedError("Columnwise-only per-tensor FP8 quantization is not implemented")
        scale = self._scale(tensor)
        # TE's casts saturate (a value past the format's max becomes the max, not inf or NaN).
        fp8_max = torch.finfo(TORCH_DTYPES[self.dtype]).max
        cast = (tensor.float() * scale).clamp(-fp8_max, fp8_max).to(TORCH_DTYPES[self.dtype])
        CALLS.append({"op": "quantize", "kind": type(self).__name__, "shape": list(tensor.shape),
                      "dtype": self.dtype.name, "scale": float(scale), "rowwise": self.rowwise_usage,
                      "columnwise": self.columnwise_usage})
        return Quantized(cast.float() / scale, self.rowwise_usage, self.columnwise_usage)


def _amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |value| in fp32; 0 for an empty tensor (an expert without rows)."""
    if tensor.numel() == 0:
        return torch.zeros((), device=tensor.device)
    return tensor.detach().abs().amax().float()


class Float8Quantizer(_Quantizer):
    """Delayed scaling: casts with the given scale; max-accumulates the amax into `amax`."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: DType, *, rowwise=True, columnwise=True):
        super().__init__(fp8_dtype)
        assert scale.dim() == 0 and amax.shape == (1,), (scale.shape, amax.shape)
        self.scale, self.amax = scale, amax

    def _scale(self, tensor):
        # Written through .data as TE's kernel writes through a pointer: no autograd version bump.
        self.amax.data.copy_(torch.maximum(self.amax.data, _amax(tensor).reshape(1)))
        return self.scale.detach().float()


class Float8CurrentScalingQuantizer(_Quantizer):
    """Current scaling: the scale of each tensor from its own amax."""

    def _scale(self, tensor):
        amax = _amax(tensor)
        fp8_max = torch.finfo(TORCH_DTYPES[self.dtype]).max
        return torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax))


class RecipeState:
    def __init__(self, quantizers):
        self._quantizers = quantizers

    @staticmethod
    def create(recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None) -> RecipeState:
        assert roles is None or len(roles) == num_quantizers
        hybrid = isinstance(recipe, (DelayedScaling, Float8CurrentScaling))
        dtype = DType.kFloat8E5M2 if hybrid and mode == "backward" else DType.kFloat8E4M3
        return RecipeState([Float8CurrentScalingQuantizer(dtype, per_tensor=hybrid) for _ in range(num_quantizers)])

    def make_quantizers(self) -> list:
        return self._quantizers


def general_gemm(A, B, out_dtype=None, quantization_params=None, gelu=False, gelu_in=None, alpha=1.0, beta=None,
                 accumulate=False, layout="TN", out=None, bias=None, use_split_accumulator=False, grad=False, **_):
    """cuBLAS's column-major D = op(A) op(B), in row-major terms: TN gives B @ A.T, NN B @ A,
    NT B.T @ A (te.Linear's forward, dgrad and wgrad)."""
    transa, transb = layout[0] == "T", layout[1] == "T"
    for name, operand, needs in (("A", A, "rowwise" if transa else "columnwise"),
                                 ("B", B, "columnwise" if transb else "rowwise")):
        assert isinstance(operand, Quantized), f"{name} was not quantized"
        assert getattr(operand, needs), f"GEMM {layout} needs {name}'s {needs} data, which was not made"
    a, b = A.values, B.values
    result = {"TN": lambda: b @ a.t(), "NN": lambda: b @ a, "NT": lambda: b.t() @ a}[layout]()
    CALLS.append({"op": "gemm", "layout": layout, "A": list(a.shape), "B": list(b.shape),
                  "split_accumulator": use_split_accumulator})
    return result.to(out_dtype), None, None, None


def general_grouped_gemm(A, B, out, quantization_params, out_dtype, layout="TN", m_splits=None, grad=False,
                         accumulate=False, use_split_accumulator=False, single_output=False, **_):
    """One `general_gemm` per group: into consecutive row blocks of `out[0]` (`single_output`, blocks
    of `m_splits` rows), else into `out[i]`; a group without rows gives zeros (TE zeroes it)."""
    assert len(A) == len(B) == len(quantization_params), (len(A), len(B), len(quantization_params))
    views = list(out[0].split(m_splits)) if single_output else out
    assert len(views) == len(A)
    for a, b, view in zip(A, B, views):
        if a.values.numel() == 0 or b.values.numel() == 0:
            if not accumulate:
                view.zero_()
            continue
        result, *_ = general_gemm(a, b, out_dtype=torch.float32, layout=layout,
                                  use_split_accumulator=use_split_accumulator, grad=grad)
        view.copy_(result + view.float() if accumulate else result)
    CALLS.append({"op": "grouped_gemm", "layout": layout, "groups": len(A), "splits": list(m_splits or []),
                  "accumulate": accumulate, "split_accumulator": use_split_accumulator})
    return out, None, None


def split_quantize(tensor, split_sections, quantizer_list, disable_bulk_allocation=False):
    """TE's bulk cast: each block of `split_sections` rows with its own quantizer."""
    assert tensor.shape[0] == sum(split_sections), (tensor.shape, split_sections)
    return [quantizer(part) for part, quantizer in zip(tensor.split(list(split_sections)), quantizer_list)]


def multi_tensor_quantize(tensor_list, quantizer_list):
    """TE's cast of several tensors in one call, each with its own quantizer."""
    assert len(tensor_list) == len(quantizer_list)
    return [quantizer(tensor) for tensor, quantizer in zip(tensor_list, quantizer_list)]


SUPPORT = {"fp8": (True, ""),
           "mxfp8": (False, "Device compute capability 10.0 or higher required for MXFP8 execution."),
           "block": (True, "")}


def _availability(kind):
    def available(return_reason: bool = False):
        return SUPPORT[kind] if return_reason else SUPPORT[kind][0]
    return available


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    return module


def modules() -> dict[str, types.ModuleType]:
    recipe = _module("transformer_engine.common.recipe", DelayedScaling=DelayedScaling,
                     Float8CurrentScaling=Float8CurrentScaling, MXFP8BlockScaling=MXFP8BlockScaling,
                     Float8BlockScaling=Float8BlockScaling)
    common = _module("transformer_engine.common", recipe=recipe)
    cpp_extensions = _module("transformer_engine.pytorch.cpp_extensions", general_gemm=general_gemm,
                             general_grouped_gemm=general_grouped_gemm)
    extension = _module("transformer_engine_torch", split_quantize=split_quantize,
                        multi_tensor_quantize=multi_tensor_quantize)
    quantization = _module("transformer_engine.pytorch.quantization", RecipeState=RecipeState)
    pytorch = _module("transformer_engine.pytorch", DType=DType, Float8Quantizer=Float8Quantizer,
                      Float8CurrentScalingQuantizer=Float8CurrentScalingQuantizer, QuantizerRole=QuantizerRole,
                      cpp_extensions=cpp_extensions, quantization=quantization,
                      is_fp8_available=_availability("fp8"), is_mxfp8_available=_availability("mxfp8"),
                      is_fp8_block_scaling_available=_availability("block"))
    package = _module("transformer_engine", pytorch=pytorch, common=common)
    return {m.__name__: m for m in (package, common, recipe, pytorch, cpp_extensions, quantization, extension)}


def install() -> None:
    """Puts the fake into sys.modules (a real TE there is an error: the tests would test it)."""
    if "transformer_engine" in sys.modules and not hasattr(sys.modules["transformer_engine"], "__fake__"):
        raise RuntimeError("a real transformer_engine is imported in this process")
    found = modules()
    found["transformer_engine"].__fake__ = True
    sys.modules.update(found)
    from parallel import te_experts, te_linear

    te_linear.kernels.cache_clear()  # kernels built with another TE (or none) must not be reused
    te_experts.kernels.cache_clear()


@contextlib.contextmanager
def installed():
    saved = {name: sys.modules.get(name) for name in modules()}
    install()
    CALLS.clear()
    try:
        yield CALLS
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        from parallel import te_experts, te_linear

        te_linear.kernels.cache_clear()
        te_experts.kernels.cache_clear()
