"""FP8 delayed scaling's state (parallel/delayed_scaling.py), without Transformer Engine: TE's
scale rule, the history, the ranks amaxes are reduced over, and checkpoints on the same and on
another mesh."""

from __future__ import annotations

import pytest
import torch

from parallel.delayed_scaling import FP8_MAX, GRAD_SCALE_KEY, SLOTS, DelayedScaling, amax_reduction_dims


E4M3, E5M2 = FP8_MAX["input"], FP8_MAX["grad_output"]


def _record(views, layer: str, matmul: int, values: tuple[float, float, float]) -> None:
    """What a quantization does to the slots: a max-accumulation into the current row."""
    amax = views[layer].amaxes[matmul]
    amax.copy_(torch.maximum(amax, torch.tensor(values)))


def test_scales_follow_the_max_of_the_history_as_transformer_engine_sets_them():
    scaling = DelayedScaling(history_len=3, margin=1)
    views = scaling.add_layers({"blocks.0": 2, "blocks.1": 1})
    assert [len(v.scales) for v in views.values()] == [2, 1]
    assert all(s.tolist() == [1.0, 1.0, 1.0] for v in views.values() for s in v.scales)  # before any amax

    _record(views, "blocks.0", 0, (2.0, 0.5, 1e-3))
    _record(views, "blocks.0", 0, (4.0, 0.25, 0.0))  # a second micro-batch: the max stays
    _record(views, "blocks.1", 0, (0.0, float("inf"), 1e-42))
    scaling.update()
    got = views["blocks.0"].scales[0].tolist()
    assert got == pytest.approx([E4M3 / 4.0 / 2, E4M3 / 0.5 / 2, E5M2 / 1e-3 / 2], rel=1e-6)
    assert views["blocks.0"].scales[1].tolist() == [1.0, 1.0, 1.0]  # no amax yet: the old scale
    # A zero or non-finite amax keeps the old scale; a scale past fp32's range becomes its max.
    assert views["blocks.1"].scales[0].tolist() == [1.0, 1.0, torch.finfo(torch.float32).max]
    assert all(a.tolist() == [0.0, 0.0, 0.0] for v in views.values() for a in v.amaxes)  # a fresh row

    # The history remembers the larger amax for history_len steps, then forgets it.
    for step, expected in enumerate([4.0, 4.0, 1.0]):
        _record(views, "blocks.0", 0, (1.0, 0.5, 1e-3))
        scaling.update()
        assert views["blocks.0"].scales[0][0].item() == pytest.approx(E4M3 / expected / 2), step


def test_history_of_one_step_is_current_scaling_one_step_late():
    scaling = DelayedScaling(history_len=1)
    views = scaling.add_layers({"head": 1})
    for amax in (8.0, 2.0):
        _record(views, "head", 0, (amax, amax, amax))
        scaling.update()
        assert views["head"].scales[0][0].item() == pytest.approx(E4M3 / amax)


def test_amaxes_are_reduced_over_the_ranks_holding_other_rows_or_columns_of_a_tensor():
    sizes = {"pp": 2, "dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 8}
    assert amax_reduction_dims(sizes) == ("dp_replicate", "dp_shard", "cp", "tp")  # never pp: other layers
    assert amax_reduction_dims({"pp": 4, "dp_shard": 1, "tp": 1}) == ()
    assert amax_reduction_dims({"dp_shard": 2, "cp": 1, "tp": 2}) == ("dp_shard", "tp")


def _trained(history_len: int = 4, grad_scale: float = 0.5, steps: int = 3) -> tuple[DelayedScaling, dict]:
    scaling = DelayedScaling(history_len=history_len, grad_scale=grad_scale)
    views = scaling.add_layers({"blocks.0": 2, "blocks.1": 1})
    for step in range(steps):
        for layer, view in views.items():
            for matmul in range(len(view.scales)):
                _record(views, layer, matmul, (1.0 + step, 2.0 + matmul, 0.1 * (step + 1)))
        scaling.update()
    return scaling, views


def test_a_checkpoint_restores_the_state_exactly_and_reshards_the_gradient_slots():
    saved, _ = _trained()
    state = saved.state_dict()
    assert set(state) == {GRAD_SCALE_KEY, "blocks.0.amax_history", "blocks.0.scale", "blocks.1.amax_history",
                          "blocks.1.scale"}
    assert {k: tuple(v.shape) for k, v in state.items()} == saved.layer_shapes()

    same, _ = _trained(steps=0)
    assert same.load_state_dict(state) == []
    for mine, theirs in zip(same.parts, saved.parts):
        assert torch.equal(mine.amax_history, theirs.amax_history) and torch.equal(mine.scale, theirs.scale)

    # Another mesh with twice the loss scale (e.g. dp=2 instead of one process): its gradients
    # are twice as large, so are their amaxes; the forward tensors' slots do not change.
    other, views = _trained(grad_scale=1.0, steps=0)
    other.load_state_dict(state)
    grad = SLOTS.index("grad_output")
    for mine, theirs in zip(other.parts, saved.parts):
        ratio = (mine.scale / theirs.scale).view(-1, 3)
        assert ratio[:, grad].tolist() == pytest.approx([0.5] * ratio.shape[0])
        assert torch.equal(ratio[:, :grad], torch.ones_like(ratio[:, :grad]))
        history = (mine.amax_history / theirs.amax_history.clamp_min(1e-30)).view(4, -1, 3)
        assert torch.all((history[..., grad] == 2.0) | (theirs.amax_history.view(4, -1, 3)[..., grad] == 0))
    # The views handed to the layers see the loaded values (loads write into the same buffers).
    assert views["blocks.1"].scales[0].tolist() == other.parts[0].scale[6:9].tolist()


@pytest.mark.parametrize("history_len", [2, 8])
def test_another_history_length_keeps_the_newest_amaxes(history_len):
    saved, _ = _trained(history_len=4, steps=6)
    resumed, _ = _trained(history_len=history_len, steps=0)
    resumed.load_state_dict(saved.state_dict())
    old, new = saved.parts[0].amax_history, resumed.parts[0].amax_history
    kept = min(4, history_len) - 1
    assert torch.equal(new[0], old[0])
    assert torch.equal(new[history_len - kept:], old[4 - kept:])  # the newest past rows are the last ones
    assert torch.count_nonzero(new[1:history_len - kept]) == 0


def test_layers_missing_from_a_checkpoint_start_afresh():
    saved, _ = _trained()
    state = {k: v for k, v in saved.state_dict().items() if not k.startswith("blocks.1.")}
    resumed, views = _trained(steps=0)
    assert resumed.load_state_dict(state) == ["blocks.1"]
    assert views["blocks.1"].scales[0].tolist() == [1.0, 1.0, 1.0]
    assert views["blocks.0"].scales[0].tolist() == saved.parts[0].scale[:3].tolist()
