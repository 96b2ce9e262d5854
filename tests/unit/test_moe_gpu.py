"""Routed blocks on a GPU (marked gpu; skipped without CUDA): a compiled block's forward and
backward with no device-to-host synchronisation (torch.cuda.set_sync_debug_mode("error") raises at
any), with bf16 experts, FP8 experts and capacity-factor dropping; and torchao's FP8 grouped GEMM
against the emulation the CPU runs (tests/unit/test_fp8_experts.py checks the emulation's recipe).

    python -m pytest -m gpu tests/unit/test_moe_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from dtrain.layout import Machine
from models import mixtral, moe, spec
from models.context import LocalContext
from models.presets import get_model_config
from parallel.expert_parallel import ExpertParallelContextMixin
from parallel.fp8_experts import AlignedRows, Fp8GroupedExperts


pytestmark = pytest.mark.gpu


# Dims of multiples of 16 (FP8), small enough for seconds.
SHAPE = "dim=256,num_heads=4,num_kv_heads=2,expert_ffn_dim=512,num_experts=8,top_k=2,vocab_size=1024"


class _Context(ExpertParallelContextMixin, LocalContext):
    """What a one-GPU run's blocks call for their experts."""


def _needs_fp8() -> None:
    if not Machine.detect().fp8_matmuls:
        pytest.skip("FP8 grouped GEMMs need compute capability 8.9 or later")
    pytest.importorskip("torchao.prototype.moe_training.fp8_grouped_mm")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_torchao_fp8_grouped_gemm_matches_its_emulation():
    _needs_fp8()
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([300, 0, 17, 1024, 5, 211, 64, 99], device="cuda")
    layout = AlignedRows(counts, int(counts.sum()))
    x = torch.randn(int(counts.sum()), 512, device="cuda", generator=generator).to(torch.bfloat16)
    w = (torch.randn(8, 1024, 512, device="cuda", generator=generator) * 0.05).to(torch.bfloat16)
    grad = torch.randn(layout.rows, 1024, device="cuda", generator=generator).to(torch.bfloat16)
    offs = torch.cumsum(layout.counts, 0, dtype=torch.int32)
    results = []
    for native in (True, False):
        xp, wp = layout.pad(x).requires_grad_(), w.clone().requires_grad_()
        out = Fp8GroupedExperts(native).grouped_mm(xp, wp, offs)
        out.backward(grad)
        counted = int(layout.counts.sum())
        results.append((out[:counted], xp.grad[:counted], wp.grad))
    for name, a, b in zip(("out", "dx", "dw"), *results):
        # The same casts; the kernels accumulate in another order (and fast accumulation).
        assert _relative(a, b) < 2e-3, f"{name}: torchao {_relative(a, b):.2e} from the emulation"


def _block(changes: str):
    cfg = get_model_config("tiny-moe", f"{SHAPE}{',' if changes else ''}{changes}")
    layer = mixtral.layers(cfg)[1]
    p = spec.unflatten({path: spec.init_value(s, 0, path, device="cuda").to(torch.bfloat16).requires_grad_(s.trainable)
                        for path, s in spec.flatten(layer.params)})
    return cfg, layer, p


@pytest.mark.parametrize("experts,changes", [("bf16", ""), ("fp8", ""), ("bf16", "capacity_factor=1.0"),
                                             ("fp8", "capacity_factor=1.0")])
def test_a_compiled_routed_block_makes_no_host_sync(experts, changes):
    if experts == "fp8":
        _needs_fp8()
    cfg, layer, p = _block(changes)
    ctx = _Context()
    if experts == "fp8":
        ctx.fp8_grouped_experts = Fp8GroupedExperts(native=True)
    stats = moe.RouterStats()
    aux = mixtral.make_aux(cfg, torch.arange(512, device="cuda"), router_stats=stats)
    block = torch.compile(layer.forward)
    x = torch.randn(2, 512, cfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    for _ in range(2):  # compiles (which may synchronise) and runs once compiled
        block(p, x, aux, ctx).backward(grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block(p, x, aux, ctx).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all() and len(stats.load) == 1
