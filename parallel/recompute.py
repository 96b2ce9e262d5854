"""Activation recompute of blocks: none, selective (keep the outputs of matmuls, grouped GEMMs,
attention, collectives and FP8 amaxes; recompute the cheap element-wise ops and norms) or full
(keep only the block input).

Partial recompute (`--recompute-layers N`, Megatron's `--recompute-num-layers` with its block
method): full recompute of the first N blocks of every pipeline stage, the others in the run's
mode. Each stage holds its own micro-batches in flight, so the saving is N blocks' activations
times that number on every stage."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.errors import UserError
from parallel import te_experts, te_linear  # noqa: F401  (register torch.ops.dtrain.te_linear and te_experts)

try:  # registers torch's variable-length attention op (torch >= 2.10), named below
    import torch.nn.attention.varlen  # noqa: F401
except ImportError:
    pass
try:  # registers the symmetric-memory matmuls of overlapped tensor parallelism, named below
    import torch.distributed._symmetric_memory  # noqa: F401
except ImportError:
    pass

RECOMPUTE_MODES = ("none", "selective", "full")

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten._scaled_mm.default,
    # Transformer Engine's FP8 matmul (parallel/te_linear.py): quantize and GEMM in one op.
    torch.ops.dtrain.te_linear.default,
    # ... and the routed experts' FP8 grouped GEMMs (parallel/te_experts.py), the SwiGLU in one op.
    torch.ops.dtrain.te_experts.default,
    # The experts' GEMMs: the bulk of an MoE block's FLOPs.
    _aten._grouped_mm.default,
    _aten._scaled_grouped_mm.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    # FP8 scaling's amax (torchao's max of |x| per tensor, amax per row): a few numbers, but
    # recomputing them reads the whole tensor again.
    _aten.max.default,
    _aten.amax.default,
    # Collectives (tensor parallelism's gathers and reductions, expert parallelism's all-to-alls):
    # recomputing one would send the same data again, in the backward's critical path.
    _c10d.all_gather_into_tensor.default,
    _c10d.reduce_scatter_tensor.default,
    _c10d.all_reduce.default,
    _c10d.all_to_all_single.default,
    _c10d.wait_tensor.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    # Tensor parallelism's matmuls with their all-gather or reduce-scatter fused in
    # (parallel/tensor_parallel.py): both a GEMM and a collective.
    *(getattr(torch.ops.symm_mem, name).default for name in
      ("fused_all_gather_matmul", "fused_matmul_reduce_scatter",
       "fused_all_gather_scaled_matmul", "fused_scaled_matmul_reduce_scatter")
      if hasattr(torch.ops.symm_mem, name)),
    # Masked attention (parallel/masked_attention.py): FlexAttention, and variable-length flash
    # attention through torch (its custom op, named per torch version, and the kernel under it).
    torch.ops.higher_order.flex_attention,
    _aten._flash_attention_forward.default,
    *(getattr(namespace, "_varlen_attn").default for namespace in
      (getattr(torch.ops, name) for name in ("torch_attn", "torch_nn_attention"))
      if hasattr(namespace, "_varlen_attn")),
}


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_expensive)


def full_recompute_blocks(blocks_per_stage: list[int], num_layers: int) -> frozenset[str]:
    """The layer names (`blocks.I`) of the first `num_layers` blocks of each stage."""
    names, first = [], 0
    for count in blocks_per_stage:
        names += [f"blocks.{first + i}" for i in range(min(num_layers, count))]
        first += count
    return frozenset(names)


def validate_partial(num_layers: int, mode: str, blocks_per_stage: list[int]) -> None:
    if num_layers < 0:
        raise UserError(f"--recompute-layers {num_layers} must be >= 0")
    if num_layers and mode == "full":
        raise UserError(f"--recompute-layers {num_layers} picks blocks for full recompute, but --recompute full "
                        f"already recomputes every block; use --recompute none or selective with it")
    if num_layers > max(blocks_per_stage):
        raise UserError(f"--recompute-layers {num_layers} is more than the {max(blocks_per_stage)} blocks of the "
                        f"largest pipeline stage; use at most {max(blocks_per_stage)}, or --recompute full")


def wrap(forward: Callable, mode: str) -> Callable:
    if mode not in RECOMPUTE_MODES:
        raise UserError(f"unknown --recompute {mode!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return forward
    context_fn = _selective_contexts if mode == "selective" else None
    kwargs = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(forward)
    def recomputed(*args):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return recomputed
