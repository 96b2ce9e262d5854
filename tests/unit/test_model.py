"""The functional core: RoPE (with Llama-3.1 scaling), attention, RMSNorm, the Llama forward,
parameter specs and their initialisation."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from models import llama, spec
from models.config import RopeScaling
from models.context import LocalContext, causal_attention
from models.layers import apply_rope, rms_norm, rope_frequencies, rope_table
from models.presets import get_model_config


def _llama31_apply_scaling(freqs: list[float], scaling: RopeScaling) -> list[float]:
    """Llama 3.1's `apply_scaling` (meta-llama/llama-models), per frequency."""
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / scaling.factor)
        else:
            smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor)
            out.append((1 - smooth) * freq / scaling.factor + smooth * freq)
    return out


def _plain_freqs(head_dim: int, theta: float) -> list[float]:
    return [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]


@pytest.mark.parametrize("scaling", [RopeScaling(), RopeScaling(factor=32.0),
                                     RopeScaling(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                                 original_max_seq_len=4096)])
def test_rope_scaling_matches_llama31(scaling):
    head_dim, theta = 128, 500000.0
    plain = _plain_freqs(head_dim, theta)
    expected = torch.tensor(_llama31_apply_scaling(plain, scaling), dtype=torch.float64)
    got = rope_frequencies(head_dim, theta, scaling)
    assert got.shape == (head_dim // 2,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    # All three regimes are exercised: kept, divided by the factor, and blended.
    plain_t = torch.tensor(plain, dtype=torch.float64)
    kept = torch.isclose(got.double(), plain_t, rtol=1e-6)
    divided = torch.isclose(got.double(), plain_t / scaling.factor, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_rope_frequencies_without_scaling():
    got = rope_frequencies(64, 10000.0, None)
    torch.testing.assert_close(got.double(), torch.tensor(_plain_freqs(64, 10000.0), dtype=torch.float64),
                               rtol=1e-6, atol=0)


def _rope(seq: int, head_dim: int, positions: torch.Tensor | None = None):
    inv_freq = rope_frequencies(head_dim, 10000.0, None)
    return rope_table(torch.arange(seq) if positions is None else positions, inv_freq)


def test_apply_rope_position_zero_is_identity_and_norms_are_kept():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16)
    cos, sin = _rope(9, 16)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[:, 0], x[:, 0], rtol=0, atol=1e-7)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y[:, 1:], x[:, 1:], atol=1e-3)   # other positions do rotate


def test_apply_rope_scores_depend_on_relative_position():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq: int, pk: int) -> torch.Tensor:
        cos_q, sin_q = _rope(1, 16, torch.tensor([pq]))
        cos_k, sin_k = _rope(1, 16, torch.tensor([pk]))
        return (apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(score(3, 3), (q * k).sum(), rtol=1e-5, atol=1e-5)


def _reference_attention(q, k, v):
    """Softmax attention with KV heads repeated to the query heads (head h uses kv head h // groups)."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    seq = q.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_causal_attention_gqa_matches_reference():
    torch.manual_seed(2)
    q = torch.randn(2, 7, 4, 8)
    k = torch.randn(2, 7, 2, 8)
    v = torch.randn(2, 7, 2, 8)
    out = causal_attention(q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(LocalContext().attention(q, k, v), out, rtol=0, atol=0)
    # Causality: changing the last position's k/v leaves earlier outputs unchanged.
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 1.0
    v2[:, -1] -= 1.0
    torch.testing.assert_close(causal_attention(q, k2, v2)[:, :-1], out[:, :-1], rtol=1e-5, atol=1e-6)


def test_causal_attention_mha_matches_reference():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 5, 2, 4) for _ in range(3))
    torch.testing.assert_close(causal_attention(q, k, v), _reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_formula():
    torch.manual_seed(4)
    x = torch.randn(3, 5, 32)
    w = torch.randn(32)
    eps = 1e-5
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    torch.testing.assert_close(rms_norm(x, w, eps), expected, rtol=1e-5, atol=1e-6)
    out_bf16 = rms_norm(x.bfloat16(), w.bfloat16(), eps)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.float(), expected, rtol=2e-2, atol=2e-2)


def _init_params(cfg, seed: int = 0, requires_grad: bool = False) -> dict:
    items = []
    for layer in llama.layers(cfg):
        for path, s in spec.flatten(layer.params):
            name = f"{layer.name}.{path}"
            items.append((name, spec.init_value(s, seed, name).requires_grad_(requires_grad)))
    return spec.unflatten(items)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_forward_loss_and_gradients(tied):
    cfg = attrs.evolve(get_model_config("tiny"), tie_embeddings=tied)
    params = _init_params(cfg, seed=0, requires_grad=True)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=generator)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=generator)
    loss_sum = llama.forward(params, tokens, labels, cfg, LocalContext())
    assert loss_sum.dim() == 0 and torch.isfinite(loss_sum)
    mean_loss = loss_sum.item() / labels.numel()
    assert abs(mean_loss - math.log(cfg.vocab_size)) < 1.0, mean_loss
    loss_sum.backward()
    leaves = list(spec.flatten(params))
    assert "head.output" in dict(leaves) or tied
    for name, value in leaves:
        assert value.grad is not None, name
        assert torch.isfinite(value.grad).all(), name
        assert value.grad.abs().sum() > 0, name


def test_llama_forward_ignores_masked_labels():
    cfg = get_model_config("tiny")
    params = _init_params(cfg, seed=1)
    generator = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), generator=generator)
    labels = torch.randint(0, cfg.vocab_size, (1, 8), generator=generator)
    full = llama.forward(params, tokens, labels, cfg, LocalContext())
    masked = labels.clone()
    masked[0, 4:] = -100
    half = llama.forward(params, tokens, masked, cfg, LocalContext())
    assert 0 < half.item() < full.item()


def test_layers_shapes_and_axes_for_tiny():
    cfg = get_model_config("tiny")
    layers = llama.layers(cfg)
    assert [layer.name for layer in layers] == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    block = dict(spec.flatten(layers[1].params))
    assert block["attn.wq"].shape == (64, 64) and block["attn.wq"].axes == ("heads", "embed")
    assert block["attn.wk"].shape == (32, 64) and block["attn.wk"].axes == ("kv_heads", "embed")
    assert block["mlp.w_down"].shape == (64, 192) and block["mlp.w_down"].axes == ("embed", "mlp")
    assert not block["attn_norm"].weight_decay and block["attn.wo"].weight_decay
    assert layers[0].params["weight"].shape == (2048, 64) and not layers[0].params["weight"].weight_decay


def test_init_value_deterministic_per_seed_and_path():
    s = spec.normal((64, 32), ("embed", "mlp"), 0.02)
    a = spec.init_value(s, 0, "blocks.0.attn.wq")
    b = spec.init_value(s, 0, "blocks.0.attn.wq")
    assert torch.equal(a, b)
    assert not torch.equal(a, spec.init_value(s, 0, "blocks.1.attn.wq"))    # another path
    assert not torch.equal(a, spec.init_value(s, 1, "blocks.0.attn.wq"))    # another seed
    assert a.shape == (64, 32) and a.dtype == torch.float32
    assert abs(a.std().item() - 0.02) < 0.002   # 2048 samples: std within 10%
    assert abs(a.mean().item()) < 0.002
    # Lower-precision values are the fp32 draw, rounded.
    torch.testing.assert_close(spec.init_value(s, 0, "blocks.0.attn.wq", dtype=torch.bfloat16), a.bfloat16(),
                               rtol=0, atol=0)
    assert spec.param_seed(0, "x") == spec.param_seed(0, "x") != spec.param_seed(0, "y")


def test_init_value_ones():
    s = spec.ones((16,), ("embed",))
    assert torch.equal(spec.init_value(s, 3, "head.norm"), torch.ones(16))


def test_flatten_unflatten_round_trip():
    tree = {"embed": {"weight": 1}, "blocks": {"0": {"attn": {"wq": 2, "wk": 3}, "attn_norm": 4}},
            "head": {"norm": 5}}
    flat = list(spec.flatten(tree))
    assert flat == [("embed.weight", 1), ("blocks.0.attn.wq", 2), ("blocks.0.attn.wk", 3),
                    ("blocks.0.attn_norm", 4), ("head.norm", 5)]
    assert spec.unflatten(iter(flat)) == tree
    assert spec.unflatten(dict(flat)) == tree
    assert list(spec.flatten(spec.unflatten(dict(flat)))) == flat
    assert list(spec.flatten(tree, "model")) == [("model." + k, v) for k, v in flat]


def test_count_params_tiny():
    cfg = get_model_config("tiny")
    d, f, v = 64, 192, 2048
    per_block = 2 * d + d * d + 2 * 32 * d + d * d + 3 * d * f
    assert spec.count_params(llama.layers(cfg)) == v * d + 4 * per_block + d + v * d


def test_head_dim_is_a_field_that_follows_dim_unless_set():
    from models.errors import UserError

    tiny = get_model_config("tiny")
    assert tiny.head_dim == 16 and get_model_config("tiny", "dim=128").head_dim == 32
    wide = get_model_config("tiny", "head_dim=32")
    assert wide.head_dim == 32 and attrs.evolve(wide, dim=128).head_dim == 32
    block = dict(spec.flatten(llama.layers(wide)[1].params))
    # Queries 4 heads x 32 = 128 wide from a 64-wide residual; the output projection back to 64.
    assert block["attn.wq"].shape == (128, 64) and block["attn.wk"].shape == (64, 64)
    assert block["attn.wo"].shape == (64, 128)
    assert llama.make_aux(wide, torch.arange(8)).rope[0].shape == (8, 32)
    params = _init_params(wide, seed=0)
    tokens = torch.randint(0, wide.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(llama.forward(params, tokens, tokens, wide, LocalContext()))
    # dim need not divide into the heads once head_dim is set.
    assert get_model_config("tiny", "dim=70,head_dim=16").head_dim == 16
    for overrides, message in (("head_dim=7", "head_dim=7 must be even"), ("dim=70", "set head_dim where")):
        with pytest.raises(UserError, match=message):
            get_model_config("tiny", overrides)
    with pytest.raises(UserError, match="MLA's heads are qk_nope_head_dim"):
        get_model_config("tiny-mla", "head_dim=16")


@pytest.mark.parametrize("model,overrides", [("tiny", "rope_theta=0"), ("tiny-moe", "norm_eps=-1e-6"),
                                             ("tiny-mla", "rope_theta=-10000"), ("tiny", "norm_eps=nan")])
def test_settings_that_make_every_loss_nan_are_refused(model, overrides):
    from models.errors import UserError

    name = overrides.split("=")[0]
    with pytest.raises(UserError, match=f"model {name}=.* must be a positive number"):
        get_model_config(model, overrides)
