"""Precision backends behind the model context's `linear`: the plain matmul in the compute dtype
(bf16 or fp32), or FP8 through torchao (tensorwise, rowwise, rowwise_with_gw_hp) or Transformer
Engine (delayed, current, mxfp8, blockwise: parallel/te_linear.py). torchao and Transformer Engine
are imported only when chosen.

An FP8 backend gives each FP8 layer its matmul (`for_layers`: layer name -> `linear(x, weight)`,
with `wrap_forward` around the layer's forward); torchao's is one stateless object for all.

FP8 all-gather under FSDP (tensorwise only): the weights of the FP8 matmuls are wrapped in
torchao's `WeightWithDynamicFloat8CastTensor` before `fully_shard`, so each rank casts its shard
to float8 and FSDP all-gathers half the bytes of bf16; the matmul takes the gathered float8
weight as it is. After each optimizer step `after_optimizer_step` computes the scales of all
those weights with one all-reduce (without it, each weight's all-gather reduces its own amax)."""

from __future__ import annotations

import dataclasses
import math
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.errors import UserError
from models.spec import ParamSpec
from parallel import te_linear
from parallel.layout import FP8Layout
from parallel.mesh import MeshSpec

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FP8_RECIPES = {"torchao": TORCHAO_RECIPES, "te": te_linear.TE_RECIPES}


def check_fp8_recipe(recipe: str | None, backend: str) -> None:
    """The recipe belongs to the backend (no GPU or TE needed: the planner checks it too)."""
    if recipe is None:
        return
    if backend not in FP8_RECIPES:
        raise UserError(f"unknown --fp8-backend {backend!r}; choose one of {', '.join(FP8_RECIPES)}")
    if recipe not in FP8_RECIPES[backend]:
        other = next((name for name, recipes in FP8_RECIPES.items() if recipe in recipes), None)
        hint = (f"{recipe} is a recipe of --fp8-backend {other}" if other else f"unknown recipe {recipe!r}")
        raise UserError(f"--fp8-backend {backend} takes --fp8 {'|'.join(FP8_RECIPES[backend])}; {hint}"
                        + ("; per-tensor dynamic scaling is --fp8 current there" if recipe == "tensorwise" else ""))


def validate_fp8(recipe: str | None, backend: str, dims: list[int], check_here: bool) -> None:
    """Before any memory: the recipe belongs to the backend, and every matmul dim FP8 sees suits the
    FP8 kernels; `check_here`: Transformer Engine is asked whether it runs the recipe on this
    machine too."""
    if recipe is None:
        return
    check_fp8_recipe(recipe, backend)
    if backend == "te":
        if check_here:
            te_linear.check_support(recipe)
        te_linear.check_dims(recipe, dims)
        return
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
        # An all-gathered float8 weight (a Float8TrainingTensor) was cast by its shard's owner
        # with the weight's scale; the matmul takes it as it is and casts only the bf16 ones.
        return self._matmul.apply(x, weight.t(), self.mm_config, self.config)

    @property
    def casts_weight_per_tensor(self) -> bool:
        """One dynamic scale per weight, for both GEMMs that use it: then one float8 copy, cast
        shard by shard with that scale, serves forward and backward. The rowwise recipes cast the
        weight twice (per row for the output, per column for the input gradient), and torchao
        gathers float8 for tensorwise scaling only."""
        from torchao.float8.config import ScalingGranularity, ScalingType

        cast = self.config.cast_config_weight
        return cast.scaling_type is ScalingType.DYNAMIC and cast.scaling_granularity is ScalingGranularity.TENSORWISE

    def enable_float8_all_gather(self) -> None:
        self.config = dataclasses.replace(self.config, enable_fsdp_float8_all_gather=True)

    def for_layers(self, matmuls: dict[str, int]) -> dict[str, Float8Linear]:
        return dict.fromkeys(matmuls, self)  # dynamic scaling: no state per layer

    @staticmethod
    def wrap_forward(forward):
        return forward


def fp8_backend(fp8: FP8Layout | None, device: torch.device, *, amax_groups: list | None = None,
                grad_scale: float = 1.0):
    """The FP8 backend of a run (None without FP8): torchao's `Float8Linear` (its casts emulated
    where the layout says the GPU has no FP8 GEMMs), or Transformer Engine's `TELinear` (delayed
    scaling reduces amaxes over `amax_groups`; see te_linear.py)."""
    if fp8 is None:
        return None
    if fp8.backend == "te":
        return te_linear.TELinear(fp8.recipe, device, amax_groups=amax_groups, grad_scale=grad_scale,
                                  amax_history_len=fp8.amax_history)
    return Float8Linear(fp8.recipe, emulate=fp8.emulated)


def fp8_blocks(num_layers: int, keep_ends: bool) -> frozenset[str]:
    """The blocks whose matmuls run in FP8: all of them, or all but the first and last."""
    keep = {0, num_layers - 1} if keep_ends else set()
    return frozenset(f"blocks.{i}" for i in range(num_layers) if i not in keep)


# The devices whose collectives move float8 tensors: NCCL does, gloo does not.
FLOAT8_COLLECTIVE_DEVICES = ("cuda",)

# The logical axes of the blocks' matmul weights (attention and MLP projections, shared experts).
# Norms (1-D), the router ("router") and routed experts ("expert", 3-D) are not FP8 matmuls.
_MATMUL_WEIGHT_AXES = frozenset({"embed", "heads", "kv_heads", "mlp"})


def is_fp8_matmul_weight(axes: tuple[str, ...]) -> bool:
    """A weight that a block passes to the context's `linear` (so to Float8Linear in FP8 blocks)."""
    return len(axes) == 2 and set(axes) <= _MATMUL_WEIGHT_AXES


# torchao's recipes that scale a weight with one dynamic scale for both GEMMs that use it: then one
# float8 copy, cast shard by shard with that scale, serves forward and backward
# (`Float8Linear.casts_weight_per_tensor` reads the same from torchao's config). The rowwise recipes
# cast the weight twice (per row for the output, per column for the input gradient).
PER_TENSOR_WEIGHT_RECIPES = ("tensorwise",)


def float8_all_gather_blocker(recipe: str, backend: str, requested: bool, mesh_spec: MeshSpec,
                              device_type: str) -> str | None:
    """Why FSDP must all-gather the FP8 blocks' weights in bf16, or None when float8 is allowed.

    bf16 stays for: Transformer Engine (it quantizes the weight FSDP has gathered in bf16), the
    rowwise recipes (a weight cast per row and again per column has no one float8 copy to gather),
    tensor parallelism (a tp-split weight is a DTensor, and dtrain's TP matmuls do not go through
    torchao's float8 TP styles), one FSDP shard (nothing to gather), and devices whose collectives
    cannot move float8 (gloo on CPU)."""
    if not requested:
        return "turned off (--no-fp8-all-gather)"
    if backend != "torchao":
        return "Transformer Engine gathers bf16 weights and quantizes them itself"
    if recipe not in PER_TENSOR_WEIGHT_RECIPES:
        return "the recipe scales weights per row"
    if mesh_spec.tp > 1:
        return "tp splits the weights"
    if mesh_spec.dp_shard * mesh_spec.cp == 1:
        return "FSDP has one shard"
    if device_type not in FLOAT8_COLLECTIVE_DEVICES:
        return f"{device_type} collectives cannot move float8"
    return None


def float8_all_gather_weights(block: nn.Module, specs: dict[str, ParamSpec]) -> list[str]:
    """Names (global, `blocks.3.attn.wq`) of a block's weights that FSDP may gather in float8."""
    fp8 = getattr(block.ctx, "fp8_linear", None)
    if not isinstance(fp8, Float8Linear):
        return []
    names = []
    for name, param in block.named_parameters():
        full = f"{block.layer_name}.{name}"
        if is_fp8_matmul_weight(specs[full].axes) and not isinstance(param, DTensor):
            names.append(full)
    return names


def wrap_for_float8_all_gather(model: nn.Module) -> list[str]:
    """Before `fully_shard`, where the layout allows it (`float8_all_gather_blocker`): wraps the FP8
    blocks' matmul weights so that FSDP all-gathers them in float8. Returns the wrapped names."""
    fp8_linears = {id(b.ctx.fp8_linear): b.ctx.fp8_linear for b in model.blocks.values()
                   if isinstance(getattr(b.ctx, "fp8_linear", None), Float8Linear)}
    if not fp8_linears:
        return []
    assert all(f.casts_weight_per_tensor for f in fp8_linears.values()), "float8 all-gather of a rowwise recipe"
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for fp8 in fp8_linears.values():
        fp8.enable_float8_all_gather()
    wrapped = []
    for block in model.blocks.values():
        fp8 = getattr(block.ctx, "fp8_linear", None)
        for full in float8_all_gather_weights(block, model.specs):
            owner_name, _, leaf = full[len(block.layer_name) + 1:].rpartition(".")
            owner = block.get_submodule(owner_name)
            param = getattr(owner, leaf)
            weight = WeightWithDynamicFloat8CastTensor(param.data, fp8.mm_config,
                                                       fp8.config.cast_config_weight.target_dtype)
            setattr(owner, leaf, nn.Parameter(weight, requires_grad=param.requires_grad))
            wrapped.append(full)
    return wrapped


def float8_gathered_params(model_parts) -> list[DTensor]:
    """The parameters FSDP all-gathers in float8 (none without a torchao float8 import)."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:
        return []
    wrapper = fsdp_utils.WeightWithDynamicFloat8CastTensor
    return [p for part in model_parts for p in part.parameters()
            if isinstance(p, DTensor) and isinstance(p._local_tensor, wrapper)]


@torch.no_grad()
def after_optimizer_step(model_parts) -> None:
    """The float8 scales of every weight FSDP gathers in float8, from its updated values, with
    one all-reduce; used by the next all-gathers (forward, and backward's re-gather). The same
    computation as torchao's `precompute_float8_dynamic_scale_for_fsdp`, which finds weights
    only on its own Float8Linear modules. A no-op when no weight is gathered in float8."""
    from_float8 = float8_gathered_params(model_parts)
    if not from_float8:
        return
    from torchao.float8.float8_utils import EPS

    (target_dtype,) = {p._local_tensor._dtype for p in from_float8}
    amax = torch.stack(torch._foreach_norm(from_float8, ord=math.inf))  # Partial over the shards
    amax = torch.clamp(amax, EPS)  # the one all-reduce: Partial -> Replicate
    # float64 as torchao does, so eager and compiled scales agree.
    scales = (torch.finfo(target_dtype).max / amax.to(torch.float64)).to_local().to(torch.float32)
    for param, scale in zip(from_float8, scales):
        param._local_tensor._precomputed_scale = scale
