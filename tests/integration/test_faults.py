"""Fault injection (`DTRAIN_FAULT`): the grammar, which rank a fault hits, and that it fires once."""

import pytest

from dtrain.resilience.faults import SPIKE_FACTOR
from tests.launch import train_scalars


def test_a_spike_multiplies_the_loss_and_gradients_of_its_step_and_only_that_step(tmp_path, single_run):
    run = train_scalars(tmp_path / "spiked", ["--steps", "4"], env={"DTRAIN_FAULT": "spike@step3"})
    assert run["train/loss"][:2] == single_run["train/loss"][:2]
    for tag in ("train/loss", "train/grad_norm"):
        assert run[tag][2] == pytest.approx(SPIKE_FACTOR * single_run[tag][2], rel=1e-5), tag
    # Clipping (the norm is above 1 either way) and AdamW absorb the factor: the next step is unharmed.
    assert run["train/loss"][3] == pytest.approx(single_run["train/loss"][3], rel=1e-5)
