"""Learning-rate schedules and AdamW weight-decay groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dtrain.config import OptimArgs
from dtrain.optim import build_optimizer, build_scheduler, lr_multiplier
from models import llama, spec
from models.presets import get_model_config


WARMUP, TOTAL, LOW = 10, 111, 0.1   # 100 steps of decay: the last update (step 110) is at the minimum


TOL = 1e-12


def _args(decay: str, **kwargs) -> OptimArgs:
    return OptimArgs(warmup_steps=WARMUP, min_lr_ratio=LOW, decay=decay, **kwargs)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_from_one_over_warmup_to_one(decay):
    args = _args(decay)
    values = [lr_multiplier(step, TOTAL, args) for step in range(WARMUP)]
    assert values[0] == pytest.approx(1 / WARMUP, abs=TOL)
    assert values[-1] == pytest.approx(1.0, abs=TOL)
    for step, value in enumerate(values):
        assert value == pytest.approx((step + 1) / WARMUP, abs=TOL)
    # The first step after warm-up is at the peak for every schedule.
    assert lr_multiplier(WARMUP, TOTAL, args) == pytest.approx(1.0, abs=TOL)


def test_cosine():
    args = _args("cosine")
    half = WARMUP + (TOTAL - WARMUP) // 2
    assert lr_multiplier(half, TOTAL, args) == pytest.approx((1 + LOW) / 2, abs=TOL)
    quarter = WARMUP + (TOTAL - WARMUP) // 4
    expected = LOW + (1 - LOW) * 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lr_multiplier(quarter, TOTAL, args) == pytest.approx(expected, abs=TOL)
    assert lr_multiplier(TOTAL, TOTAL, args) == pytest.approx(LOW, abs=TOL)
    assert lr_multiplier(TOTAL + 50, TOTAL, args) == pytest.approx(LOW, abs=TOL)   # clamped
    decay = [lr_multiplier(s, TOTAL, args) for s in range(WARMUP, TOTAL + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_linear():
    args = _args("linear")
    assert lr_multiplier(WARMUP + 50, TOTAL, args) == pytest.approx(1 - (1 - LOW) * 0.5, abs=TOL)
    assert lr_multiplier(WARMUP + 25, TOTAL, args) == pytest.approx(1 - (1 - LOW) * 0.25, abs=TOL)
    assert lr_multiplier(TOTAL, TOTAL, args) == pytest.approx(LOW, abs=TOL)
    assert lr_multiplier(TOTAL + 5, TOTAL, args) == pytest.approx(LOW, abs=TOL)


def test_constant():
    args = _args("constant")
    for step in (WARMUP, WARMUP + 50, TOTAL - 1, TOTAL, TOTAL + 10):
        assert lr_multiplier(step, TOTAL, args) == 1.0


def test_wsd_flat_then_linear_to_min():
    args = _args("wsd", decay_fraction=0.2)   # stable for 80 steps after warm-up, decays for 20
    for step in range(WARMUP, WARMUP + 81):
        assert lr_multiplier(step, TOTAL, args) == pytest.approx(1.0, abs=TOL), step
    assert lr_multiplier(WARMUP + 85, TOTAL, args) == pytest.approx(1 - (1 - LOW) * 5 / 20, abs=TOL)
    assert lr_multiplier(WARMUP + 90, TOTAL, args) == pytest.approx(1 - (1 - LOW) * 10 / 20, abs=TOL)
    assert lr_multiplier(TOTAL, TOTAL, args) == pytest.approx(LOW, abs=TOL)
    assert lr_multiplier(TOTAL + 3, TOTAL, args) == pytest.approx(LOW, abs=TOL)


def test_no_warmup():
    args = OptimArgs(warmup_steps=0, min_lr_ratio=LOW, decay="linear")
    assert lr_multiplier(0, 101, args) == pytest.approx(1.0, abs=TOL)
    assert lr_multiplier(50, 101, args) == pytest.approx(1 - (1 - LOW) / 2, abs=TOL)
    assert lr_multiplier(100, 101, args) == pytest.approx(LOW, abs=TOL)


def test_unknown_decay_raises():
    with pytest.raises(ValueError, match="exponential"):
        lr_multiplier(WARMUP + 1, TOTAL, _args("exponential"))


def _module_from_tree(tree: dict) -> nn.Module:
    module = nn.Module()
    for key, value in tree.items():
        if isinstance(value, dict):
            module.add_module(key, _module_from_tree(value))
        else:
            module.register_parameter(key, nn.Parameter(value))
    return module


def _tiny_model():
    torch.manual_seed(0)
    layers = llama.layers(get_model_config("tiny"))
    specs = {f"{layer.name}.{path}": s for layer in layers for path, s in spec.flatten(layer.params)}
    model = _module_from_tree(spec.unflatten({name: torch.randn(s.shape) for name, s in specs.items()}))
    model.specs = specs  # what build_optimizer reads from each model part
    return model, specs


def test_build_optimizer_weight_decay_groups():
    model, specs = _tiny_model()
    names = {id(p): name for name, p in model.named_parameters()}
    assert set(names.values()) == set(specs)
    args = OptimArgs(lr=1e-3, weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-7)
    optimizer = build_optimizer([model], args)
    assert len(optimizer.param_groups) == 2
    groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    assert set(groups) == {0.05, 0.0}
    no_decay = groups[0.0]
    decay = groups[0.05]
    expected_no_decay = {"embed.weight", "head.norm"} | {
        f"blocks.{i}.{n}" for i in range(4) for n in ("attn_norm", "mlp_norm")
    }
    expected_decay = {"head.output"} | {
        f"blocks.{i}.{n}" for i in range(4)
        for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")
    }
    assert no_decay == expected_no_decay
    assert decay == expected_decay
    for group in optimizer.param_groups:
        assert group["lr"] == 1e-3 and group["betas"] == (0.8, 0.9) and group["eps"] == 1e-7


def test_build_optimizer_all_no_decay_has_one_group():
    model = _module_from_tree({"norm": torch.ones(4)})
    model.specs = {"norm": spec.ones((4,), ("embed",))}
    optimizer = build_optimizer([model], OptimArgs())
    assert len(optimizer.param_groups) == 1
    assert optimizer.param_groups[0]["weight_decay"] == 0.0


def test_scheduler_applies_multiplier():
    model, specs = _tiny_model()
    args = OptimArgs(lr=2e-3, warmup_steps=4, decay="linear", min_lr_ratio=0.5)
    optimizer = build_optimizer([model], args)
    scheduler = build_scheduler(optimizer, 8, args)
    seen = []
    for _ in range(9):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [2e-3 * lr_multiplier(s, 8, args) for s in range(9)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[-1] == pytest.approx(1e-3, rel=1e-12)


def test_non_trainable_parameters_get_no_optimizer_state():
    model = _module_from_tree({"w": torch.randn(4, 4), "bias": torch.zeros(4)})
    model.bias.requires_grad_(False)
    model.specs = {"w": spec.normal((4, 4), ("embed", "embed"), 0.02),
                   "bias": spec.ParamSpec((4,), ("router",), "normal", 0.0, trainable=False)}
    optimizer = build_optimizer([model], OptimArgs())
    assert [p for g in optimizer.param_groups for p in g["params"]] == [model.w]
