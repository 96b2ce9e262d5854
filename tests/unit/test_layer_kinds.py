"""Per-layer attention kinds (models.config.LAYER_KINDS): the pattern, its checks, one mask per
kind built once per micro-batch, and each block attending with its own kind's mask."""

from __future__ import annotations

import pytest
import torch

from models import llama, masking, spec
from models.presets import get_model_config
from models.context import LocalContext
from models.errors import UserError


def test_the_pattern_repeats_over_the_layers():
    cfg = get_model_config("tiny", "num_layers=5,layer_pattern=window-full,sliding_window=8")
    assert cfg.layer_kinds == ("window", "full", "window", "full", "window")
    assert get_model_config("tiny", "sliding_window=8").layer_kinds == ("window",) * 4
    assert get_model_config("tiny").layer_kinds == ("full",) * 4


@pytest.mark.parametrize("overrides,message", [
    ("layer_pattern=full-sliding", "names 'sliding'; its kinds, joined by '-' and repeated over the layers, are full"),
    ("layer_pattern=window-full", "has 'window' layers but sliding_window is none"),
    ("layer_pattern=chunk", "has 'chunk' layers but attention_chunk is none"),
    ("layer_pattern=full-nope,sliding_window=8", "sliding_window=8 is set but no layer is a 'window' layer"),
    ("layer_pattern=chunk,attention_chunk=0", "attention_chunk=0 must be >= 1"),
])
def test_a_pattern_that_does_not_fit_is_a_one_line_error(overrides, message):
    with pytest.raises(UserError, match=message):
        get_model_config("tiny", overrides)
    with pytest.raises(UserError, match="MLA's keys carry RoPE"):
        get_model_config("tiny-mla", "layer_pattern=full-nope")


def test_each_block_attends_with_the_mask_of_its_kind():
    """A window, a chunk and a NoPE layer each change the loss on their own; with a window and a
    chunk as long as the sequence, and RoPE on the NoPE layer, it is the plain model's."""
    base = get_model_config("tiny")
    ctx = LocalContext()
    # Weights 10 times the init's, so that attention at initialisation is far from uniform.
    tree = spec.unflatten({f"{layer.name}.{path}": spec.init_value(s, 0, f"{layer.name}.{path}") * (10 if s.std else 1)
                           for layer in llama.layers(base) for path, s in spec.flatten(layer.params)})
    tokens = torch.randint(0, base.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)

    def loss(overrides: str) -> float:
        cfg = get_model_config("tiny", overrides) if overrides else base
        return llama.forward(tree, tokens, labels, cfg, ctx).item()

    plain = loss("")
    assert loss("layer_pattern=window-full-chunk-full,sliding_window=32,attention_chunk=32") == pytest.approx(plain, rel=1e-6)
    for kinds in ("layer_pattern=window-full,sliding_window=5", "layer_pattern=chunk-full,attention_chunk=8",
                  "layer_pattern=full-nope"):
        assert abs(loss(kinds) - plain) > 1e-2 * plain, kinds
    masks = masking.layer_masks(get_model_config("tiny", "layer_pattern=window-chunk-nope,sliding_window=5,"
                                                 "attention_chunk=8"), ctx, torch.zeros(2, 32, dtype=torch.int64))
    assert set(masks) == {"window", "chunk", "full"} and masks["full"] is None
    assert masks["chunk"].first_key[0, 17].item() == 16 and masks["window"].first_key[0, 17].item() == 13
