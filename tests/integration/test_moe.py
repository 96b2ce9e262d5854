"""The mixture-of-experts core: routing, dispatch with and without capacity, the grouped expert
GEMM, router losses and their straight-through gradient, auxiliary-loss-free bias balancing, the
MoE model forward and the presets' sizes. Every reference here is written per token, by hand."""

from __future__ import annotations

import types

import torch

from models import moe
from models.context import LocalContext
from tests.unit.test_moe import CFG, _moe_params


def test_compiled_layers_record_stats_without_a_recompile_per_layer(monkeypatch):
    """Every MoE block compiles the same function: recording router statistics (a dict that grows
    layer by layer) and the per-expert loop of the CPU fallback (rows per expert that change with
    every input) must not make each call a new graph; past torch's recompile limit the blocks would
    silently run uncompiled."""
    # One compile with the first layer's values, one with them dynamic: nothing more.
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    torch._dynamo.reset()
    p, stats = _moe_params(CFG), moe.RouterStats()
    aux = types.SimpleNamespace(router_stats=stats)
    compiled = torch.compile(moe.moe_forward)
    torch.manual_seed(0)
    for micro_batch in range(2):
        for layer in range(10):
            compiled(p, torch.randn(2, 8, CFG.dim), CFG, LocalContext(), layer=layer, aux=aux)
    assert sorted(stats.load) == list(range(10))
    assert all(int(totals[-1]) == 2 for totals in stats.totals.values())  # two records per layer
    torch._dynamo.reset()
