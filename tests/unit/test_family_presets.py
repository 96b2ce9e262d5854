"""The gpt-oss and Llama 4 presets: the published sizes' parameter counts, and every shape field of
the four tiny presets of today's families settable from the command line (what `--init-from-hf`
of a tiny checkpoint needs). Qwen3's counts are in tests/unit/test_qwen3.py."""

from __future__ import annotations

import attrs
import pytest

from models import families, flops, spec
from models.presets import _OVERRIDE_PARSERS, get_model_config


@pytest.mark.parametrize("name,total,active", [
    # The model cards: 20.9B with 3.6B active and 116.8B with 5.1B active, the input embedding not
    # counted as active (the output head is).
    ("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13),
    # 17B active (both embeddings counted) of 109B and 400B; the totals include the vision tower,
    # which the text model here leaves out (Scout's text model is 107.8B).
    ("llama4-scout-17b-16e", 107.77, 17.17), ("llama4-maverick-17b-128e", 400.71, 17.18),
])
def test_published_sizes_have_their_parameter_counts(name, total, active):
    cfg = get_model_config(name)
    assert round(spec.count_params(families.layers(cfg)) / 1e9, 2) == total
    embedding = cfg.vocab_size * cfg.dim if name.startswith("gpt-oss") else 0
    assert round((flops.active_params(cfg) - embedding) / 1e9, 2) == active


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-llama4"])
def test_every_field_of_the_tiny_presets_is_settable(name):
    """Every field but RoPE's scaling (which the presets give as published, and the command line
    only switches off) parses from text."""
    cfg = get_model_config(name)
    fields = {f.alias: f.type for f in attrs.fields(type(cfg))}
    assert not [alias for alias, kind in fields.items() if kind not in _OVERRIDE_PARSERS]
    assert get_model_config(name, "rope_scaling=none").rope_scaling is None
