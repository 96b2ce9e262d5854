"""The routed experts' SwiGLU in Transformer Engine's FP8 grouped GEMMs (`--fp8-experts`, with
`--fp8-backend te`): gate and up, then down, each one grouped GEMM over this rank's experts.

Measured on an H200 it is slower than torch's bf16 grouped GEMM, so it is a flag, off by default:
alone (`python -m tools.bench_experts`) and in training, the host stopping at each block to read
the row counts (benchmarks/experts.jsonl and the README have the figures).

As for the dense matmuls (parallel/te_linear.py), the weights stay dtrain's: the op takes this
rank's block of experts ([E, out, in] local tensors) and quantizes each expert's weight itself;
it saves the bf16 input and weights, and the gate and up outputs (what the bf16 experts save),
and quantizes again in backward. Each expert is its own three matmuls (gate, up, down) with
delayed scaling's three slots each, indexed by its global expert id, so every rank keeps the
same state and the amax reduction over the data ranks (from which expert parallelism borrows
its ranks) gives each expert's amaxes to all. Gate and up read one quantization of the input,
made with the gate matmul's input slot; the up matmul's input slot stays unused.

FP8 GEMMs need every dim a multiple of 16 (the recipe's block for the block recipes), and an
expert's rows are a dim of its weight-gradient GEMM, so each expert's rows are padded with zero
rows to that multiple (the op's outputs drop them again). The row counts must be on the host
for TE: the op reads them once in forward and once in backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from parallel import te_linear
from parallel.fp8_experts import padded_rows

# Gate, up and down: the matmuls of one expert, in the order of the slot block's rows.
MATMULS = 3


class GroupedKernels:
    """TE's split quantization and grouped GEMM for one recipe, with the dense matmuls' quantizers."""

    def __init__(self, recipe: str):
        te_linear.import_te()
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

        self.dense = te_linear.kernels(recipe)
        self.align = te_linear.ALIGNMENT[recipe]
        self.split_quantize = tex.split_quantize
        self.multi_quantize = tex.multi_tensor_quantize
        self.grouped_gemm = general_grouped_gemm

    def _quantizers(self, scale: Tensor, amax: Tensor, first: int, experts: int) -> list[list[tuple]]:
        """[matmul][expert] -> (input, weight, output gradient) quantizers of this rank's experts;
        `scale` and `amax` are [MATMULS x all experts, 3] blocks. Looked up once per block (its
        3 x experts slots would otherwise be looked up one by one at every call)."""
        total = scale.shape[0] // MATMULS
        return self.dense.cached(
            ("experts", scale.data_ptr(), amax.data_ptr(), first, experts),
            lambda: [[self.dense.quantizers(scale[m * total + first + e], amax[m * total + first + e])
                      for e in range(experts)] for m in range(MATMULS)])

    def _quantize_rows(self, rows: Tensor, splits: list[int], quantizers: list, rowwise: bool, columnwise: bool):
        """Each expert's block of rows with its quantizer (one call)."""
        return self.split_quantize(rows, splits, _with_usage(quantizers, rowwise, columnwise))

    def _quantize_weights(self, weights: Tensor, quantizers: list, rowwise: bool, columnwise: bool) -> list:
        """Each expert's weight with its quantizer (one call)."""
        return self.multi_quantize(list(weights.unbind(0)), _with_usage(quantizers, rowwise, columnwise))

    def _gemm(self, a: list, b: list, out: Tensor, splits: list[int], layout: str, accumulate: bool = False):
        """cuBLAS's layouts as in te_linear: TN is b @ a.T (forward) and NN b @ a (input gradient),
        into one [rows, ...] output; NT b.T @ a (weight gradients), into `out`'s [expert] slices."""
        single = layout != "NT"
        gemm = {"TN": "fprop", "NN": "dgrad", "NT": "wgrad"}[layout]
        self.grouped_gemm(a, b, [out] if single else list(out), [None] * len(a), out.dtype, layout=layout,
                          m_splits=splits, grad=layout != "TN", accumulate=accumulate,
                          use_split_accumulator=self.dense.split_accumulator[gemm], single_output=single)
        return out

    def forward(self, x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, scale: Tensor,
                amax: Tensor, first: int) -> tuple[Tensor, Tensor, Tensor]:
        layout = PaddedRows(counts, x.shape[0], self.align)
        (gate_q, up_q, down_q) = self._quantizers(scale, amax, first, counts.numel())
        inputs = self._quantize_rows(layout.pad(x), layout.splits, [q[0] for q in gate_q], True, False)
        gate = self._gemm(self._quantize_weights(w_gate, [q[1] for q in gate_q], True, False), inputs,
                          x.new_empty(layout.rows, w_gate.shape[1]), layout.splits, "TN")
        up = self._gemm(self._quantize_weights(w_up, [q[1] for q in up_q], True, False), inputs,
                        x.new_empty(layout.rows, w_up.shape[1]), layout.splits, "TN")
        hidden = self._quantize_rows(F.silu(gate) * up, layout.splits, [q[0] for q in down_q], True, False)
        out = self._gemm(self._quantize_weights(w_down, [q[1] for q in down_q], True, False), hidden,
                         x.new_empty(layout.rows, w_down.shape[1]), layout.splits, "TN")
        return layout.unpad(out), gate, up

    def backward(self, grad: Tensor, x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                 gate: Tensor, up: Tensor, scale: Tensor, amax: Tensor, first: int) -> tuple[Tensor, ...]:
        layout = PaddedRows(counts, x.shape[0], self.align)
        splits, both = layout.splits, self.dense.rowwise_with_columnwise
        (gate_q, up_q, down_q) = self._quantizers(scale, amax, first, counts.numel())
        # Down: its input gradient (NN) and weight gradient (NT).
        grad_out = self._quantize_rows(layout.pad(grad), splits, [q[2] for q in down_q], True, True)
        grad_hidden = self._gemm(self._quantize_weights(w_down, [q[1] for q in down_q], both, True), grad_out,
                                 x.new_empty(layout.rows, w_down.shape[2]), splits, "NN")
        hidden = F.silu(gate) * up
        grad_w_down = self._gemm(self._quantize_rows(hidden, splits, [q[0] for q in down_q], both, True), grad_out,
                                 torch.empty_like(w_down), splits, "NT")
        # SwiGLU's gradients as autograd computes them for the bf16 experts (the same roundings: an
        # FP8 cast of the gradients turns a bf16 ulp of difference into an FP8 step).
        grad_up = grad_hidden * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
        # Gate and up: one input gradient, summed over both; their weight gradients from one input.
        inputs = self._quantize_rows(layout.pad(x), splits, [q[0] for q in gate_q], both, True)
        grad_x = x.new_empty(layout.rows, x.shape[1])
        grads_w = []
        for grad_rows, weights, quantizers, accumulate in ((grad_gate, w_gate, gate_q, False),
                                                           (grad_up, w_up, up_q, True)):
            grad_q = self._quantize_rows(grad_rows, splits, [q[2] for q in quantizers], True, True)
            self._gemm(self._quantize_weights(weights, [q[1] for q in quantizers], both, True), grad_q, grad_x,
                       splits, "NN", accumulate=accumulate)
            grads_w.append(self._gemm(inputs, grad_q, torch.empty_like(weights), splits, "NT"))
        return layout.unpad(grad_x), *grads_w, grad_w_down


def _with_usage(quantizers: list, rowwise: bool, columnwise: bool) -> list:
    for quantizer in quantizers:
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    return quantizers


class PaddedRows:
    """The experts' rows (sorted by expert, `counts` each) with each expert's padded to a multiple
    of `align`. The padded buffers have a fixed number of rows for a given row count (the last
    expert takes the slack), so that compiled graphs see fixed shapes. Rows past the counted ones
    (an all-gather dispatch's slots for other ranks' experts) are left out, and come back zero."""

    def __init__(self, counts: Tensor, rows: int, align: int):
        self.counts, self.align, self.input_rows = counts, align, rows
        routed = counts.tolist()
        self.routed = sum(routed)
        self.splits = [-(-n // align) * align for n in routed]
        self.rows = padded_rows(rows, counts.numel(), align)
        self.splits[-1] += self.rows - sum(self.splits)

    @functools.cached_property
    def positions(self) -> Tensor:
        """Each counted row's place in the padded layout."""
        padding = (self.counts + self.align - 1) // self.align * self.align - self.counts
        shift = torch.cumsum(padding, 0) - padding
        return torch.arange(self.routed, device=self.counts.device) + torch.repeat_interleave(
            shift, self.counts, output_size=self.routed)

    def pad(self, rows: Tensor) -> Tensor:
        return rows.new_zeros(self.rows, rows.shape[1]).index_copy_(0, self.positions, rows[:self.routed])

    def unpad(self, padded: Tensor) -> Tensor:
        rows = padded.index_select(0, self.positions)
        if self.routed == self.input_rows:
            return rows
        return torch.cat([rows, rows.new_zeros(self.input_rows - self.routed, rows.shape[1])])


@functools.cache
def kernels(recipe: str) -> GroupedKernels:
    return GroupedKernels(recipe)


# As dtrain::te_linear: `amax` is written by max-accumulation only, so the op is declared pure.
@torch.library.custom_op("dtrain::te_experts", mutates_args=())
def te_experts(x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, scale: Tensor,
               amax: Tensor, first: int, recipe: str) -> tuple[Tensor, Tensor, Tensor]:
    return kernels(recipe).forward(x, counts, w_gate, w_up, w_down, scale, amax, first)


@te_experts.register_fake
def _(x, counts, w_gate, w_up, w_down, scale, amax, first, recipe):
    rows = padded_rows(x.shape[0], counts.shape[0], te_linear.ALIGNMENT[recipe])
    return x.new_empty(x.shape), x.new_empty(rows, w_gate.shape[1]), x.new_empty(rows, w_up.shape[1])


@torch.library.custom_op("dtrain::te_experts_backward", mutates_args=())
def te_experts_backward(grad: Tensor, x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                        gate: Tensor, up: Tensor, scale: Tensor, amax: Tensor, first: int,
                        recipe: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return kernels(recipe).backward(grad, x, counts, w_gate, w_up, w_down, gate, up, scale, amax, first)


@te_experts_backward.register_fake
def _(grad, x, counts, w_gate, w_up, w_down, gate, up, scale, amax, first, recipe):
    return torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)


def _save_for_backward(ctx, inputs, output):
    x, counts, w_gate, w_up, w_down, scale, amax, first, recipe = inputs
    _, gate, up = output
    ctx.save_for_backward(x, counts, w_gate, w_up, w_down, gate, up, scale, amax)
    ctx.first, ctx.recipe = first, recipe
    ctx.mark_non_differentiable(gate, up)


def _backward(ctx, grad, _grad_gate, _grad_up):
    x, counts, w_gate, w_up, w_down, gate, up, scale, amax = ctx.saved_tensors
    grads = te_experts_backward(grad.contiguous(), x, counts, w_gate, w_up, w_down, gate, up, scale, amax,
                                ctx.first, ctx.recipe)
    return grads[0], None, *grads[1:], None, None, None, None


te_experts.register_autograd(_backward, setup_context=_save_for_backward)


class LayerExperts:
    """One MoE layer's routed experts in FP8, called as `experts(x, counts, w_gate, w_up, w_down)`
    on this rank's rows and block of experts (the first of which is global expert `first`)."""

    def __init__(self, recipe: str, scale: Tensor, amax: Tensor, eval_amax: Tensor):
        self.recipe, self.scale, self.amax, self.eval_amax = recipe, scale, amax, eval_amax

    def __call__(self, x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                 first: int = 0) -> Tensor:
        # An evaluation leaves the scaling state as it was.
        amax = self.amax if torch.is_grad_enabled() else self.eval_amax
        return torch.ops.dtrain.te_experts(x, counts, w_gate, w_up, w_down, self.scale, amax, first, self.recipe)[0]


def for_layers(backend: te_linear.TELinear, experts: dict[str, int]) -> dict[str, LayerExperts]:
    """The FP8 experts of each layer in `experts` (layer name -> its routed experts, all ranks'),
    with delayed scaling's slots as layer `NAME.experts` of `backend`'s state."""
    slots = {f"{name}.experts": MATMULS * count for name, count in experts.items()}
    if backend.scaling is None:
        scale, amax = backend.no_slots
        blocks = {name: (scale.expand(count, 3), amax.expand(count, 3)) for name, count in slots.items()}
    else:
        views = backend.scaling.add_layers(slots)
        blocks = {name: (view.scale_block, view.amax_block) for name, view in views.items()}
    layers = {}
    for name in experts:
        scale, amax = blocks[f"{name}.experts"]
        layers[name] = LayerExperts(backend.recipe, scale, amax, eval_amax=torch.zeros_like(amax))
    return layers
