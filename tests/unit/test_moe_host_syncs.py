"""A routed block reads nothing back from the device: routing, the router's losses and statistics,
the permutation, the grouped GEMMs (the kernel a GPU runs) and the un-permutation run from counts
that stay device tensors, in every expert variant, dropless and with a capacity.

On CPU the block runs forward and backward on fake tensors, in bf16 experts and FP8 ones, which hold no values: any read of a
value (`.item()`, `.tolist()`, `bool(t)`, `int(t)`) or any shape that depends on values (`nonzero`,
boolean indexing, `unique`, `bincount`) raises there; `.cpu()` and `.numpy()`, which fake tensors
allow, are made to raise too. The GPU counterpart (tests/unit/test_moe_gpu.py) runs a compiled step
under torch.cuda.set_sync_debug_mode("error")."""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from models import moe, spec
from models.context import LocalContext, grouped_swiglu
from models.presets import get_model_config
from parallel.expert_parallel import ExpertParallelContextMixin
from parallel.fp8_experts import Fp8GroupedExperts


VARIANTS = {
    "mixtral": ("tiny-moe", ""),
    "capacity": ("tiny-moe", "capacity_factor=1.0,z_loss_coef=0.001"),
    "deepseek-v3 routing": ("tiny-moe", "score_func=sigmoid,num_expert_groups=4,topk_groups=2,"
                                        "bias_update_rate=0.001,num_shared_experts=1,routed_scaling_factor=2.5"),
    "balanced": ("tiny-moe", "force_load_balance=true"),
    "gpt-oss": ("tiny-gpt-oss", ""),
    "llama4": ("tiny-llama4", ""),
    "qwen3-moe": ("tiny-qwen3-moe", ""),
}


class _SingleDeviceContext(ExpertParallelContextMixin, LocalContext):
    """The parallel context's experts on one device (no ep group): what a one-GPU run calls."""


@pytest.fixture
def no_host_copies(monkeypatch):
    def refuse(name):
        def call(self, *args, **kwargs):
            raise AssertionError(f"the routed block called Tensor.{name}()")
        return call

    for name in ("cpu", "numpy", "tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


def _run_block(cfg, ctx, dtype=torch.bfloat16) -> None:
    specs = moe.moe_params(cfg, std=0.02, out_std=0.02)
    p = spec.unflatten({name: torch.randn(s.shape, dtype=dtype).requires_grad_(s.trainable)
                        for name, s in spec.flatten(specs)})
    x = torch.randn(2, 16, cfg.dim, dtype=dtype, requires_grad=True)
    aux = types.SimpleNamespace(router_stats=moe.RouterStats(), loss_scale=0.5)
    out = moe.moe_forward(p, x, cfg, ctx, layer=0, aux=aux)
    out.backward(torch.randn_like(out))
    assert x.grad is not None and p["router"].grad is not None


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8 experts"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_routed_block_forward_and_backward_reads_nothing_back(variant, fp8, no_host_copies):
    preset, overrides = VARIANTS[variant]
    cfg = get_model_config(preset, overrides)
    ctx = _SingleDeviceContext()
    if fp8:  # the FP8 experts' aligned layout and casts (emulated: no FP8 kernel on fake tensors)
        ctx.fp8_grouped_experts = Fp8GroupedExperts(native=False)
    with FakeTensorMode():
        _run_block(cfg, ctx)


@pytest.mark.parametrize("read", ["tolist", "int"])
def test_the_guard_catches_a_host_read(read, no_host_copies):
    """The check can fail: the per-expert loop (the CPU path) reads the row counts as a list, and
    a count read as a number is a data-dependent value."""
    class ReadingContext(_SingleDeviceContext):
        def experts(self, x, counts, *weights, **variant):
            if read == "tolist":
                return grouped_swiglu(x, counts, *weights, use_grouped_mm=False, **variant)
            return x * int(counts[0])

    with FakeTensorMode(), pytest.raises((AssertionError, DataDependentOutputException)):
        _run_block(get_model_config("tiny-moe"), ReadingContext())
