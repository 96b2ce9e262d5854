"""Indexed data through the trainer: a preprocessed corpus trains with validation passes and
document masking, and the masks and positions reach attention as they should."""

import math

import pytest

from tests.launch import train_scalars


@pytest.mark.slow
def test_indexed_blend_trains_with_validation_and_document_mask(tmp_path, indexed_corpus):
    blend = f"0.5 {indexed_corpus} 0.5 {indexed_corpus}"
    scalars = train_scalars(tmp_path, ["--data", blend, "--split", "90,10,0", "--eval-every", "5",
                                       "--eval-steps", "2", "--document-mask", "--reset-position-ids"])
    assert len(scalars["val/loss"]) == 2  # after steps 5 and 10
    assert all(math.isfinite(v) and 4.0 < v < 9.0 for v in scalars["val/loss"]), scalars["val/loss"]
    assert scalars["train/loss"][-1] < scalars["train/loss"][0]
