"""Skipping bad steps: a non-finite loss or gradient norm, or a loss spike, leaves the weights, the
AdamW state and the MoE router bias as they were, on every rank; the schedule and the data move
on; too many skips in a row stop the run; a resumed run skips what the uninterrupted one skipped."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.resilience.step_guard import StepGuard
from dtrain.trainer import Trainer
from models.errors import UserError
from tests.launch import TINY_ARGS
from tests.layouts import resolved


def test_the_fused_adamw_on_the_cpu_matches_foreach_and_a_found_inf_leaves_everything_as_it_was():
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(8, 4, generator=generator) for _ in range(2)]
    runs = {}
    for fused in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in initial]
        runs[fused] = (params, torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2,
                                                 betas=(0.9, 0.95), fused=fused, foreach=not fused))
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=generator) for t in initial]
        for fused, (params, optimizer) in runs.items():
            for p, g in zip(params, grads):
                p.grad = g.clone() if fused else g * 0.5  # the fused step divides by grad_scale
            if fused:
                optimizer.grad_scale = torch.tensor(2.0)
                optimizer.found_inf = torch.tensor(0.0)
            optimizer.step()
    for a, b in zip(runs[True][0], runs[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the same update to rounding
    params, optimizer = runs[True]
    before = [p.detach().clone() for p in params] + [v.clone() for p in params for v in optimizer.state[p].values()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    after = list(params) + [v for p in params for v in optimizer.state[p].values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # weights, moments and step count
    assert int(optimizer.state[params[0]]["step"]) == 3


def _guard(**kwargs) -> StepGuard:
    defaults = dict(max_skipped_steps=3, spike_factor=3.0, spike_window=2, global_tokens=10, device=torch.device("cpu"))
    return StepGuard(**{**defaults, **kwargs})


def _decide(guard: StepGuard, loss: float, norm: float = 1.0) -> bool:
    return bool(guard.decide(torch.tensor(loss * guard.global_tokens), torch.tensor(norm)).found_inf)


def test_non_finite_values_skip_at_once_and_spikes_once_the_window_is_full():
    guard = _guard()
    assert [_decide(guard, x) for x in (50.0, 8.0)] == [False, False]  # no median yet: no spike
    assert _decide(guard, 30.0)  # above 3 x median(50, 8)
    assert not _decide(guard, 20.0)  # the skipped spike did not enter the window
    assert _decide(guard, math.nan) and _decide(guard, 5.0, norm=math.inf) and _decide(guard, 5.0, norm=math.nan)
    assert guard.recent.tolist() == [8.0, 20.0]
    no_spikes = _guard(spike_factor=0.0)
    assert [_decide(no_spikes, x) for x in (1.0, 1.0, 1e6, math.inf)] == [False, False, False, True]


def test_the_detector_state_round_trips_and_decides_the_same():
    guard = _guard(spike_window=3)
    for loss in (9.0, 8.0, 7.5, 70.0):
        _decide(guard, loss)
    for step, skipped in ((1, False), (2, False), (3, False), (4, True)):
        guard.record(step, skipped, 70.0, 1.0, 8.0)
    resumed = _guard(spike_window=3)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.skipped_steps == [4] and resumed.in_a_row == 1
    for loss in (24.0, 23.0, 7.0):
        assert _decide(resumed, loss) == _decide(guard, loss)
    # A smaller window keeps the newest losses.
    smaller = _guard(spike_window=2)
    smaller.load_state_dict(guard.state_dict())
    assert smaller.recent.tolist() == guard.recent[1:].tolist() and int(smaller.num_recent) == 2
    fresh = _guard()
    fresh.load_state_dict(None)  # a checkpoint from before skips existed
    assert fresh.skipped_steps == [] and int(fresh.num_recent) == 0


def test_too_many_skips_in_a_row_stop_with_one_line():
    guard = _guard(max_skipped_steps=2)
    guard.record(1, True, math.nan, 1.0, math.nan)
    guard.record(2, False, 7.0, 1.0, math.nan)  # an update in between starts the count again
    guard.record(3, True, 7.0, math.nan, math.nan)
    with pytest.raises(UserError, match=r"steps 3-4 were all skipped \(loss 7, gradient norm nan at step 4\)") as info:
        guard.record(4, True, 7.0, math.nan, math.nan)
    assert "\n" not in str(info.value) and "--max-skipped-steps 2" in str(info.value)
    assert guard.skipped_steps == [1, 3, 4]


@pytest.mark.parametrize("flags", [["--max-skipped-steps", "0"], ["--skip-spikes", "0.5"], ["--spike-window", "0"]])
def test_flags_that_cannot_work_are_refused_before_any_work(flags):
    with pytest.raises(UserError, match=r"--max-skipped-steps .* must be >= 1, --skip-spikes .* 0 \(off\) or above 1"):
        resolved([*TINY_ARGS, *flags])


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    names = {p: name for name, p in trainer.model.named_parameters()}
    for param, values in trainer.optimizer.state.items():
        state.update({f"{names[param]}.{key}": value.clone() for key, value in values.items()})
    return state


