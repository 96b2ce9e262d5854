"""Transformer Engine's FP8 matmuls behind the model context's `linear` (`--fp8-backend te`).

    --fp8 delayed    DelayedScaling: per-tensor scales from the amax history of past steps
    --fp8 current    Float8CurrentScaling: per-tensor scales from each tensor's own amax
    --fp8 mxfp8      MXFP8BlockScaling: one scale per 32 values (Blackwell GPUs)
    --fp8 blockwise  Float8BlockScaling: 1x128 blocks of activations and gradients, 128x128 of
                     weights (Hopper GPUs with CUDA 12.9+)

Parameters stay dtrain's (DTensors, sharded by FSDP2 and gathered in bf16); TE only quantizes
and multiplies this rank's shards. `ParallelContext.linear` hands each matmul its local input and
weight and lays the output out as the plan says (column then row, with sequence parallelism), so
every collective stays DTensor's. No TE module owns a weight: the matmul is TE's quantizers and
`general_gemm`, driven as te.Linear and te.ops.BasicLinear drive them.

The matmul is the torch custom op `dtrain::te_linear`: torch.compile keeps it as one node of the
block's graph, and selective recompute keeps its output like any other matmul's. It saves its
bf16 input and weight and quantizes them again (column-wise) in backward, as torchao's matmul
does, so nothing quantized outlives the op and a recomputed forward has nothing to get wrong.
Delayed scaling's state (amax histories and scales) is `parallel.delayed_scaling`'s.

TE is imported only when chosen; `tests/fake_te.py` stands in for it on machines without CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError
from parallel.delayed_scaling import DelayedScaling

TE_RECIPES = ("delayed", "current", "mxfp8", "blockwise")
_RECIPE_CLASSES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling",
                   "mxfp8": "MXFP8BlockScaling", "blockwise": "Float8BlockScaling"}
# TE's own check of whether this GPU (and CUDA) runs the recipe; its reason says what is missing.
_SUPPORT_CHECKS = {"delayed": "is_fp8_available", "current": "is_fp8_available",
                   "mxfp8": "is_mxfp8_available", "blockwise": "is_fp8_block_scaling_available"}
# What every matmul dim and the token count must be a multiple of: the FP8 GEMM's 16, or the
# recipe's block of values that share a scale.
ALIGNMENT = {"delayed": 16, "current": 16, "mxfp8": 32, "blockwise": 128}


def import_te():
    """transformer_engine.pytorch, or a one-line UserError that says how to get it."""
    try:
        import transformer_engine.pytorch as te
    except (ImportError, OSError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise UserError(f"--fp8-backend te needs Transformer Engine, which does not import here ({reason}): "
                        f"pip install -e '.[te]' on a CUDA machine, or use --fp8-backend torchao") from None
    return te


def make_recipe(name: str):
    """TE's recipe object for one of TE_RECIPES, with TE's defaults."""
    import_te()
    from transformer_engine.common import recipe as te_recipe

    return getattr(te_recipe, _RECIPE_CLASSES[name])()


def check_support(recipe: str) -> None:
    """Before any memory: TE imports and runs `recipe` on this GPU."""
    te = import_te()
    try:
        supported, reason = getattr(te, _SUPPORT_CHECKS[recipe])(return_reason=True)
    except (RuntimeError, AssertionError, AttributeError) as error:
        supported, reason = False, f"no CUDA device ({type(error).__name__}: {str(error)[:100]})"
    if not supported:
        others = "delayed or current" if recipe in ("mxfp8", "blockwise") else "--fp8-backend torchao"
        raise UserError(f"--fp8 {recipe} does not run here: {str(reason).strip()}; use {others}")


def check_dims(recipe: str, dims: list[int]) -> None:
    """Every matmul dim suits TE's kernels for `recipe` (and the tokens: `check_tokens`)."""
    align = ALIGNMENT[recipe]
    odd = sorted({d for d in dims if d % align})
    if odd:
        raise UserError(f"--fp8 {recipe} needs every matmul dim to be a multiple of {align}, but the model has "
                        f"{odd}; change the model shape or the recipe")


def check_tokens(recipe: str, tokens: int) -> None:
    """The tokens of each matmul suit TE's kernels for `recipe`."""
    align = ALIGNMENT[recipe]
    if tokens % align:
        raise UserError(f"--fp8 {recipe} needs the tokens of each matmul (micro-batch x sequence per rank = "
                        f"{tokens}) to be a multiple of {align}; change --micro-batch or --seq-len")


class TEKernels:
    """Every call dtrain makes into TE, for one recipe: its quantizers and the GEMM."""

    def __init__(self, recipe: str):
        te = import_te()
        from transformer_engine.pytorch.cpp_extensions import general_gemm
        from transformer_engine.pytorch.quantization import RecipeState

        self.name = recipe
        self.recipe = make_recipe(recipe)
        self.gemm = general_gemm
        # te.Linear's choice: the recipe's where it names one, else TE's module defaults.
        self.split_accumulator = {
            gemm: getattr(getattr(self.recipe, f"fp8_gemm_{gemm}", None), "use_split_accumulator", default)
            for gemm, default in (("fprop", False), ("dgrad", True), ("wgrad", True))}
        self.shared = None
        # What `cached` made: delayed scaling's quantizers, by the storage of their slots (and, for
        # the experts op, the rank's block of experts); they keep the slots alive, so `forget`
        # drops them with a run.
        self.made: dict[tuple, Any] = {}
        # TE's per-tensor cast makes the column-wise (transposed) copy only beside the row-wise one.
        self.rowwise_with_columnwise = recipe in ("delayed", "current")
        if recipe == "delayed":
            # TE's HYBRID format, as parallel.delayed_scaling.FP8_MAX assumes.
            self.delayed_quantizer = te.Float8Quantizer
            self.fp8_dtypes = (te.DType.kFloat8E4M3, te.DType.kFloat8E4M3, te.DType.kFloat8E5M2)
        else:
            def roles(*kinds):
                return [te.QuantizerRole(module_type="linear", tensor_type=kind) for kind in kinds]

            # Stateless recipes: one set of quantizers serves every matmul.
            forward = RecipeState.create(self.recipe, mode="forward", num_quantizers=2,
                                         roles=roles("input", "weight")).make_quantizers()
            backward = RecipeState.create(self.recipe, mode="backward", num_quantizers=1,
                                          roles=roles("grad_output")).make_quantizers()
            self.shared = self._configure((*forward, *backward))

    def _configure(self, quantizers: tuple) -> tuple:
        # Storage objects, not tensor subclasses: they only feed the GEMMs. GEMM-ready scale
        # layouts for inputs and gradients (as te.ops.BasicLinear asks) and for MXFP8 weights
        # (as te.Linear does).
        for quantizer, for_gemm in zip(quantizers, (True, self.name == "mxfp8", True)):
            quantizer.internal = True
            quantizer.optimize_for_gemm = for_gemm
        return quantizers

    def quantizers(self, scale: Tensor, amax: Tensor) -> tuple:
        """(input, weight, output gradient) quantizers; delayed scaling's read `scale` [3] and
        max-accumulate into `amax` [3], the matmul's slots of parallel.delayed_scaling. Made once
        per pair of slots: the slots are state buffers that live as long as the run, and making
        TE's quantizers costs the host more than a matmul of a 2048-wide layer takes the GPU."""
        if self.shared is not None:
            return self.shared
        return self.cached((scale.data_ptr(), amax.data_ptr()), lambda: self._configure(tuple(
            self.delayed_quantizer(scale[i], amax[i:i + 1], dtype) for i, dtype in enumerate(self.fp8_dtypes))))

    def cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()`, once per key until `forget`: delayed scaling's quantizers, which hold their
        state slots."""
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def forget(self) -> None:
        """Drops the quantizers made so far, with the state slots they hold; they are made again
        on first use."""
        self.made.clear()

    def forward(self, x: Tensor, weight: Tensor, scale: Tensor, amax: Tensor) -> Tensor:
        q_input, q_weight, _ = self.quantizers(scale, amax)
        q_input.set_usage(rowwise=True, columnwise=False)
        q_weight.set_usage(rowwise=True, columnwise=False)
        rows = x.reshape(-1, x.shape[-1])
        # general_gemm(A, B) with TN layout is B @ A.T: here x @ weight.T.
        out, *_ = self.gemm(q_weight(weight), q_input(rows), out_dtype=x.dtype,
                            use_split_accumulator=self.split_accumulator["fprop"])
        return out.view(*x.shape[:-1], weight.shape[0])

    def backward(self, grad: Tensor, x: Tensor, weight: Tensor, scale: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
        q_input, q_weight, q_grad = self.quantizers(scale, amax)
        # Row-wise gradient for dgrad, column-wise for wgrad; column-wise weight and input (the
        # per-tensor recipes make it only beside the row-wise data).
        q_grad.set_usage(rowwise=True, columnwise=True)
        q_weight.set_usage(rowwise=self.rowwise_with_columnwise, columnwise=True)
        q_input.set_usage(rowwise=self.rowwise_with_columnwise, columnwise=True)
        grad_rows = q_grad(grad.reshape(-1, grad.shape[-1]))
        grad_x, *_ = self.gemm(q_weight(weight), grad_rows, out_dtype=x.dtype, layout="NN", grad=True,
                               use_split_accumulator=self.split_accumulator["dgrad"])
        grad_w, *_ = self.gemm(q_input(x.reshape(-1, x.shape[-1])), grad_rows, out_dtype=weight.dtype,
                               layout="NT", grad=True, use_split_accumulator=self.split_accumulator["wgrad"])
        return grad_x.view(x.shape), grad_w


@functools.cache
def kernels(recipe: str) -> TEKernels:
    return TEKernels(recipe)


# The op's state arguments are views of delayed scaling's buffers. The op writes into `amax`
# (a max-accumulation that nothing reads before the step's `update`, and that gives the same
# result in any order and any number of times), so it is declared free of mutations: compiled
# graphs then pass the buffers' own storage and need no copies back.
@torch.library.custom_op("dtrain::te_linear", mutates_args=())
def te_linear(x: Tensor, weight: Tensor, scale: Tensor, amax: Tensor, recipe: str) -> Tensor:
    return kernels(recipe).forward(x, weight, scale, amax)


@te_linear.register_fake
def _(x, weight, scale, amax, recipe):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dtrain::te_linear_backward", mutates_args=())
def te_linear_backward(grad: Tensor, x: Tensor, weight: Tensor, scale: Tensor, amax: Tensor,
                       recipe: str) -> tuple[Tensor, Tensor]:
    return kernels(recipe).backward(grad, x, weight, scale, amax)


@te_linear_backward.register_fake
def _(grad, x, weight, scale, amax, recipe):
    return torch.empty_like(x), torch.empty_like(weight)


def _save_for_backward(ctx, inputs, output):
    x, weight, scale, amax, recipe = inputs
    ctx.save_for_backward(x, weight, scale, amax)
    ctx.recipe = recipe


def _backward(ctx, grad):
    x, weight, scale, amax = ctx.saved_tensors
    grad_x, grad_w = te_linear_backward(grad.contiguous(), x, weight, scale, amax, ctx.recipe)
    return grad_x, grad_w, None, None, None


te_linear.register_autograd(_backward, setup_context=_save_for_backward)


class LayerLinear:
    """One layer's TE matmuls, called by the layer's context as `linear(x, weight)` on local
    tensors. A forward calls them in the same order every time (the model's code fixes it), so
    the k-th call of a forward is matmul k, with its own delayed-scaling slots. `wrap_forward`
    restarts the count at each forward; its recompute (a forward run again) counts afresh."""

    on_local_shards = True

    def __init__(self, recipe: str, scales: tuple[Tensor, ...], amaxes: tuple[Tensor, ...], eval_amax: Tensor):
        self.recipe, self.scales, self.amaxes, self.eval_amax = recipe, scales, amaxes, eval_amax
        self.next_matmul = 0
        # The routed experts' grouped matmuls (parallel.te_experts.LayerExperts), where they are FP8
        # (set by parallel.parallelize under --fp8-experts).
        self.experts = None

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        index = self.next_matmul
        if index >= len(self.scales):
            raise RuntimeError(f"a forward called {index + 1} FP8 matmuls, more than the {len(self.scales)} its "
                               f"layer's FP8 matmul weights allow")
        self.next_matmul = index + 1
        # A forward without gradients (an evaluation) leaves the scaling state as it was.
        amax = self.amaxes[index] if torch.is_grad_enabled() else self.eval_amax
        return torch.ops.dtrain.te_linear(x, weight, self.scales[index], amax, self.recipe)

    def wrap_forward(self, forward: Callable) -> Callable:
        # Reset before (a recompute that torch stopped early leaves the count where it stopped)
        # and after (under torch.compile the count is then the same at the end of a checkpointed
        # region as at its start, which the region's graph requires).
        @functools.wraps(forward)
        def counted(*args):
            self.next_matmul = 0
            out = forward(*args)
            self.next_matmul = 0
            return out

        return counted


class TELinear:
    """`--fp8-backend te` for a run: builds each FP8 layer's `LayerLinear`, owns delayed
    scaling's state (`scaling`, None for the stateless recipes)."""

    on_local_shards = True

    def __init__(self, recipe: str, device: torch.device, *, amax_groups: list | None = None,
                 grad_scale: float = 1.0, amax_history_len: int = 1024):
        self.recipe = recipe
        if recipe == "delayed":
            # The quantizers of earlier runs in this process (their slots included) are not needed now.
            kernels(recipe).forget()
        margin = kernels(recipe).recipe.margin if recipe == "delayed" else 0
        self.scaling = (DelayedScaling(history_len=amax_history_len, margin=margin, device=device,
                                       amax_groups=amax_groups, grad_scale=grad_scale)
                        if recipe == "delayed" else None)
        # Where evaluations write their amaxes; the slots the stateless recipes' matmuls ignore.
        self.eval_amax = torch.zeros(3, device=device)
        self.no_slots = (torch.ones(3, device=device), torch.zeros(3, device=device))

    def for_layers(self, matmuls: dict[str, int]) -> dict[str, LayerLinear]:
        """One `LayerLinear` per layer name, given how many FP8 matmuls a forward of it makes."""
        if self.scaling is None:
            scale, amax = self.no_slots
            return {name: LayerLinear(self.recipe, (scale,) * count, (amax,) * count, self.eval_amax)
                    for name, count in matmuls.items()}
        views = self.scaling.add_layers(matmuls)
        return {name: LayerLinear(self.recipe, view.scales, view.amaxes, self.eval_amax)
                for name, view in views.items()}
