"""The DeepSeek family's pieces, one process: the presets' sizes against the published ones, MLA
against a per-head reference, YaRN against transformers, group-limited routing and the ranks it
bounds under expert parallelism, multi-token prediction's targets and loss weight, the FLOPs of
MLA and MTP, and where MTP goes in a pipeline."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from dtrain.checkpoint.storage import shape_difference
from dtrain.metrics import mtp_scalars
from models import deepseek, flops, llama, mla, moe, mtp, spec
from models.config import DeepSeekConfig, YarnScaling
from models.context import LocalContext
from models.errors import UserError
from models.layers import rope_frequencies
from models.presets import get_model_config
from parallel import pipeline
from parallel.expert_parallel import max_ranks_per_token


def _params(cfg, seed: int = 0, std: float | None = None) -> dict:
    layers = deepseek.layers(cfg)
    values = {}
    for layer in layers:
        for path, s in spec.flatten(layer.params):
            if std is not None and s.init == "normal":
                s = attrs.evolve(s, std=std)
            values[f"{layer.name}.{path}"] = spec.init_value(s, seed, f"{layer.name}.{path}").requires_grad_(s.trainable)
    return spec.unflatten(values)


def _counts(name: str) -> tuple[float, float, float]:
    """Parameters of the main model, of the MTP modules, and active per token without the input
    embedding (DeepSeek's published "activated" count), in billions."""
    cfg = get_model_config(name)
    layers = deepseek.layers(cfg)
    main = spec.count_params([layer for layer in layers if layer.name != "mtp"])
    mtp_params = spec.count_params([layer for layer in layers if layer.name == "mtp"])
    active = flops.active_params(cfg, with_mtp=False) - cfg.vocab_size * cfg.dim
    return main / 1e9, mtp_params / 1e9, active / 1e9


def test_deepseek_v3_has_the_published_sizes():
    main, mtp_params, active = _counts("deepseek-v3")
    # Published: 671B in the main model, 36.6B of them activated (0.9B of it the output head), and
    # an MTP module of 11.5B besides the shared embedding and head. The MTP count here is 0.9%
    # above: it includes the module's 0.1B projection eh_proj, which the published figure seems not to.
    assert main == pytest.approx(671.0, abs=0.05)
    assert active == pytest.approx(36.6, abs=0.05)
    assert mtp_params == pytest.approx(11.5, rel=0.01)


def test_deepseek_v2_lite_has_the_published_sizes():
    main, mtp_params, active = _counts("deepseek-v2-lite")
    # Published: 15.7B total, 2.4B activated (computed here: 2.45B).
    assert main == pytest.approx(15.7, abs=0.05) and mtp_params == 0
    assert active == pytest.approx(2.4, rel=0.025)


def test_deepseek_v3_preset_is_the_published_shape():
    cfg = get_model_config("deepseek-v3")
    assert (cfg.num_layers, cfg.first_dense_layers, cfg.num_experts, cfg.num_shared_experts, cfg.top_k) == (61, 3, 256, 1, 8)
    assert (cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor, cfg.mtp_depth) == (8, 4, 2.5, 1)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (cfg.num_heads, cfg.dim, cfg.expert_ffn_dim, cfg.dense_ffn_dim, cfg.vocab_size) == (128, 7168, 2048, 18432, 129280)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _reference_mla(p: dict, x: torch.Tensor, cfg: DeepSeekConfig, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """MLA written out: the scores as the sum of the per-head no-position part and the rotary part
    against the one rotary key of each token, rotated pair by pair; `allowed` [batch, seq, seq]
    limits the keys further."""
    batch, seq, _ = x.shape
    heads, nope, rotary, v_dim, half = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim // 2
    q = x @ p["wq"].T if "wq" in p else _rms(x @ p["wq_a"].T, p["q_norm"]) @ p["wq_b"].T
    q = q.view(batch, seq, heads, nope + rotary)
    kv_a = x @ p["wkv_a"].T
    kv = (_rms(kv_a[..., :cfg.kv_lora_rank], p["kv_norm"]) @ p["wkv_b"].T).view(batch, seq, heads, nope + v_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * rope_frequencies(rotary, cfg.rope_theta, cfg.rope_scaling).double()
    factor = cfg.rope_scaling.attention_factor() if cfg.rope_scaling else 1.0
    cos, sin = (angles.cos() * factor).float(), (angles.sin() * factor).float()

    def rotate(t):  # t [..., seq, (heads,) rotary]: dims j and j + half turn together
        c, s = (u.view(seq, *([1] * (t.dim() - 3)), half) for u in (cos, sin))
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    q_rope = rotate(q[..., nope:])                     # [batch, seq, heads, rotary]
    k_rope = rotate(kv_a[..., cfg.kv_lora_rank:])      # [batch, seq, rotary], one per token
    scores = torch.einsum("bihd,bjhd->bhij", q[..., :nope], kv[..., :nope])
    scores = scores + torch.einsum("bihd,bjd->bhij", q_rope, k_rope)
    scores = scores * mla.softmax_scale(cfg)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), kv[..., nope:])
    return out.reshape(batch, seq, heads * v_dim) @ p["wo"].T


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 0, "rope_scaling": None}], ids=["q-lora-yarn", "plain"])
def test_mla_equals_the_per_head_reference(overrides):
    cfg = attrs.evolve(get_model_config("tiny-mla"), **overrides)
    p = _params(cfg, std=0.2)["blocks"]["0"]["attn"]
    with torch.no_grad():
        p["q_norm" if cfg.q_lora_rank else "kv_norm"].uniform_(0.5, 1.5)
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(0))
    out = mla.attention(p, x, mla.rope(cfg, torch.arange(12)), cfg, LocalContext())
    torch.testing.assert_close(out, _reference_mla(p, x, cfg), rtol=1e-5, atol=1e-5)


def test_mla_takes_the_document_and_window_mask_of_the_other_attention():
    cfg = get_model_config("tiny-mla")
    p = _params(cfg, std=0.2)["blocks"]["0"]["attn"]
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(1))
    document_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 2 + [2] * 7])
    window = 4
    ctx = LocalContext()
    out = mla.attention(p, x, mla.rope(cfg, torch.arange(12)), cfg, ctx, ctx.attention_mask(document_ids, window))
    position = torch.arange(12)
    allowed = ((document_ids[:, :, None] == document_ids[:, None, :])
               & (position[:, None] - position[None, :] < window)[None])
    expected = _reference_mla(p, x, cfg, allowed)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The mask matters here: plain causal MLA differs.
    assert (mla.attention(p, x, mla.rope(cfg, torch.arange(12)), cfg, ctx) - expected).abs().max() > 1e-2


def test_softmax_scale_follows_yarn_mscale_all_dim():
    cfg = get_model_config("tiny-mla")  # qk 16 + 8, YaRN factor 4 with mscale_all_dim 1
    assert mla.softmax_scale(cfg) == pytest.approx(24 ** -0.5 * (0.1 * math.log(4) + 1) ** 2, rel=1e-12)
    assert mla.softmax_scale(attrs.evolve(cfg, rope_scaling=None)) == 24 ** -0.5


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 1.0), (0.707, 0.707), (0.0, 0.0), (0.0, 1.0)])
def test_yarn_equals_transformers(mscale, mscale_all_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, **({"mscale": mscale} if mscale else {}),
            **({"mscale_all_dim": mscale_all_dim} if mscale_all_dim else {})}
    hf_config = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    scaling = YarnScaling(factor=40.0, original_max_seq_len=4096, mscale=mscale, mscale_all_dim=mscale_all_dim)
    torch.testing.assert_close(rope_frequencies(64, 10000.0, scaling), inv_freq, rtol=1e-6, atol=0)
    assert scaling.attention_factor() == pytest.approx(attention_factor, rel=1e-12)


ROUTED = DeepSeekConfig(dim=16, num_layers=2, num_heads=2, num_kv_heads=2, vocab_size=32, num_experts=8, top_k=3,
                        expert_ffn_dim=8, score_func="sigmoid", num_expert_groups=4, topk_groups=2,
                        routed_scaling_factor=2.5, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)


def _hand_group_route(x, router, bias, cfg):
    """Per token: group scores (sum of the two best biased sigmoid scores, or the best softmax
    score), the best topk_groups groups, the top_k experts inside them, their unbiased scores
    renormalised and scaled."""
    size = cfg.num_experts // cfg.num_expert_groups
    out = []
    for row in x:
        logits = [float(router[e] @ row) for e in range(cfg.num_experts)]
        if cfg.score_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        else:
            scores = [math.exp(v - max(logits)) / sum(math.exp(u - max(logits)) for u in logits) for v in logits]
        keys = [s + float(bias[e]) for e, s in enumerate(scores)]
        groups = [keys[g * size:(g + 1) * size] for g in range(cfg.num_expert_groups)]
        group_score = [sum(sorted(g)[-2:]) if cfg.score_func == "sigmoid" else max(g) for g in groups]
        kept = sorted(range(cfg.num_expert_groups), key=lambda g: -group_score[g])[:cfg.topk_groups]
        candidates = [e for e in range(cfg.num_experts) if e // size in kept]
        chosen = sorted(candidates, key=lambda e: -keys[e])[:cfg.top_k]
        weights = [scores[e] for e in chosen]
        total = sum(weights) if cfg.route_norm else 1.0
        out.append((sorted(chosen), {e: scores[e] / total * cfg.routed_scaling_factor for e in chosen}))
    return out


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_group_limited_routing_matches_hand_computation(score_func):
    cfg = attrs.evolve(ROUTED, score_func=score_func)
    generator = torch.Generator().manual_seed(0)
    x, router = torch.randn(64, cfg.dim, generator=generator), torch.randn(cfg.num_experts, cfg.dim, generator=generator)
    bias = torch.randn(cfg.num_experts, generator=generator) * 0.05
    routing = moe.route(x, router, cfg, bias)
    for t, (chosen, weights) in enumerate(_hand_group_route(x, router, bias, cfg)):
        ids = routing.expert_ids[t].tolist()
        assert sorted(ids) == chosen, t
        torch.testing.assert_close(routing.weights[t], torch.tensor([weights[e] for e in ids]), rtol=1e-5, atol=1e-6)
    # The groups change the choice of some tokens: routing over all experts would pick others.
    ungrouped = moe.route(x, router, attrs.evolve(cfg, num_expert_groups=1, topk_groups=1), bias)
    assert not torch.equal(ungrouped.expert_ids.sort(-1).values, routing.expert_ids.sort(-1).values)


def test_groups_bound_the_ranks_a_token_is_sent_to():
    """With 8 experts on 4 ranks in 4 groups (a group per rank), 2 groups per token put each token's
    3 experts on at most 2 ranks; without groups some tokens reach 3."""
    generator = torch.Generator().manual_seed(1)
    x, router = torch.randn(256, ROUTED.dim, generator=generator), torch.randn(8, ROUTED.dim, generator=generator)
    ep, per_rank = 4, 2

    def ranks_per_token(cfg):
        ids = moe.route(x, router, cfg).expert_ids
        return [len(set((row // per_rank).tolist())) for row in ids]

    assert max_ranks_per_token(8, ep, 3, 4, 2) == 2
    assert max(ranks_per_token(ROUTED)) == 2
    assert max_ranks_per_token(8, ep, 3) == 3
    assert max(ranks_per_token(attrs.evolve(ROUTED, num_expert_groups=1, topk_groups=1))) == 3
    # Groups wider than a rank's experts span several ranks each; DeepSeek-V3 on 64 ranks: 4 groups of 8 ranks.
    assert max_ranks_per_token(8, ep, 3, 2, 1) == 2
    assert max_ranks_per_token(256, 64, 8, 8, 4) == 8 and max_ranks_per_token(256, 8, 8, 8, 4) == 4


def test_future_targets_are_the_tokens_ahead_of_the_whole_sequence():
    labels = torch.tensor([[11, 12, 13, 14, 15]])  # labels[i] is token i+1
    targets = mtp.future_targets(labels, depth=2)
    assert targets.shape == (1, 5, 2, 2)
    assert targets[0, :, 0, 0].tolist() == [11, 12, 13, 14, 15]     # depth 1 reads token i+1 ...
    assert targets[0, :, 0, 1].tolist() == [12, 13, 14, 15, -100]   # ... and predicts token i+2
    assert targets[0, :, 1, 0].tolist() == [12, 13, 14, 15, 0]
    assert targets[0, :, 1, 1].tolist() == [13, 14, 15, -100, -100]
    packed = mtp.packed_targets(labels, 2)
    assert packed.shape == (1, 5, 5)
    unpacked_labels, unpacked = mtp.unpack_targets(packed, 2)
    assert torch.equal(unpacked_labels, labels) and torch.equal(unpacked, targets)


def test_two_mtp_depths_each_predict_further_and_are_logged_apart():
    cfg = attrs.evolve(get_model_config("tiny-mla"), mtp_depth=2, num_layers=2, first_dense_layers=1)
    params = _params(cfg)
    assert set(params["mtp"]) == {"0", "1"} and "router_bias" in params["mtp"]["1"]["block"]["moe"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    stats, router = mtp.MTPStats(), moe.RouterStats()
    deepseek.forward(params, tokens, tokens.roll(-1, 1), cfg, LocalContext(), router, stats).backward()
    # Depth k has 16 - k labels per sample; its MoE block is layer num_layers + k - 1.
    assert [t[1].item() for _, t in sorted(stats.totals.items())] == [2 * 15, 2 * 14]
    scalars = mtp_scalars(stats)
    assert set(scalars) == {"train/mtp_loss", "train/mtp_loss/depth_1", "train/mtp_loss/depth_2"}
    assert scalars["train/mtp_loss"] == pytest.approx((scalars["train/mtp_loss/depth_1"] + scalars["train/mtp_loss/depth_2"]) / 2)
    assert sorted(router.load) == [1, 2, 3] and deepseek.block_path(cfg, 3) == "mtp.1.block"
    assert params["mtp"]["1"]["eh_proj"].grad is not None and params["mtp"]["1"]["eh_proj"].grad.any()


def _mtp_gradients(weight: float):
    # Without router losses, which reach the MTP block's weights whatever the MTP weight.
    cfg = attrs.evolve(get_model_config("tiny-mla"), mtp_loss_weight=weight, num_layers=2, first_dense_layers=1,
                       aux_loss_coef=0.0)
    params = _params(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    stats = mtp.MTPStats()
    loss = deepseek.forward(params, tokens, labels, cfg, LocalContext(), mtp_stats=stats)
    loss.backward()
    return loss.detach(), stats, params


def test_mtp_loss_joins_the_gradient_with_its_weight_and_is_logged_apart():
    loss_1, stats_1, params_1 = _mtp_gradients(0.1)
    loss_2, stats_2, params_2 = _mtp_gradients(0.2)
    loss_0, stats_0, params_0 = _mtp_gradients(0.0)
    # The returned loss is the next-token loss alone; the MTP loss is the same whatever its weight.
    assert torch.equal(loss_1, loss_2) and torch.equal(loss_1, loss_0)
    assert stats_1.totals[0][1] == 2 * 15 and torch.equal(stats_1.totals[0], stats_2.totals[0])
    assert mtp_scalars(stats_1)["train/mtp_loss"] == pytest.approx((stats_1.totals[0][0] / 30).item())
    # The MTP module's own weights get gradients in proportion to the weight, none at weight 0;
    # the main blocks' include the MTP part too.
    eh = [p["mtp"]["0"]["eh_proj"].grad for p in (params_1, params_2, params_0)]
    torch.testing.assert_close(eh[1], 2 * eh[0], rtol=1e-5, atol=1e-8)
    assert eh[2] is None or not eh[2].any()
    first = [p["blocks"]["0"]["attn"]["wo"].grad for p in (params_1, params_2, params_0)]
    mtp_part = first[0] - first[2]
    assert mtp_part.abs().max() > 1e-3 * first[2].abs().max()
    # Within 0.1% of the MTP part: the difference of two fp32 sums of both parts rounds.
    torch.testing.assert_close(first[1] - first[2], 2 * mtp_part, rtol=0, atol=1e-3 * mtp_part.abs().max().item())


def test_mtp_and_head_take_the_split_backward_of_zero_bubble_schedules():
    """zb and zbv pipeline schedules take the last stage's input gradients first and its weight
    gradients later, walking the graph from the intermediates that lead to each weight once. The
    head's weights, which MTP shares, must not sit downstream of the MTP graph (a loss attached to
    the hidden state put them there: the weight pass then walked freed parts of the graph)."""
    from torch.distributed.pipelining import _backward

    cfg = attrs.evolve(get_model_config("tiny-mla"), num_layers=2, first_dense_layers=1)
    layers = {layer.name: layer for layer in deepseek.layers(cfg)}
    params = _params(cfg)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    aux = attrs.evolve(deepseek.make_aux(cfg, torch.arange(16), labels), mtp_targets=mtp.future_targets(labels, 1))
    x = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(6), requires_grad=True)
    loss = sum(llama.run_layers([layers[name]], params, x, aux, LocalContext()) for name in ("head", "mtp"))
    weights = [p for name in ("embed", "mtp", "head") for _, p in spec.flatten(params[name]) if p.requires_grad]
    expected = torch.autograd.grad(loss, weights, retain_graph=True)
    _, groups = _backward.stage_backward_input([loss], None, [x], iter(weights))
    _backward.stage_backward_weight(iter(weights), groups)
    for weight, grad in zip(weights, expected):
        torch.testing.assert_close(weight.grad, grad, rtol=1e-5, atol=1e-7)


def test_deepseek_v2_lite_flops_count_mla_and_active_experts():
    d, heads, qk, v, latent, rope = 2048, 16, 192, 128, 512, 64
    attention = heads * qk * d + (latent + rope) * d + heads * (128 + v) * latent + d * heads * v
    dense = 3 * d * 10944
    moe_layer = 64 * d + 6 * 3 * 1408 * d + 3 * 2 * 1408 * d  # router, 6 active experts, 2 shared
    n = 27 * attention + dense + 26 * moe_layer + 102400 * d  # and the output head
    cfg = get_model_config("deepseek-v2-lite")
    assert flops.matmul_params(cfg) == n
    # Scores over 16 x 192 dims and values over 16 x 128, forward and backward, in every layer.
    assert flops.flops_per_token(cfg, 4096) == 6 * n + 6 * 4096 * heads * (qk + v) * 27


def test_mtp_modules_count_their_block_projection_and_the_shared_head():
    cfg = get_model_config("deepseek-v3")
    without = attrs.evolve(cfg, mtp_depth=0)
    block = deepseek.layers(cfg)[-2].params["0"]["block"]
    active_block = sum(math.prod(s.shape) // (cfg.num_experts if len(s.shape) == 3 else 1) * (cfg.top_k if len(s.shape) == 3 else 1)
                       for _, s in spec.flatten(block) if len(s.shape) >= 2)
    extra = active_block + cfg.dim * 2 * cfg.dim + cfg.vocab_size * cfg.dim
    assert flops.matmul_params(cfg) - flops.matmul_params(without) == extra
    attention_layer = 6 * 4096 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert flops.flops_per_token(cfg, 4096) - flops.flops_per_token(without, 4096) == 6 * extra + attention_layer


@pytest.mark.parametrize("model", ["tiny-mla", "deepseek-v3"])
def test_the_pipeline_split_places_every_block_once_and_mtp_is_not_one(model):
    """The MTP layer rides with the last stage like the head; a split (balanced or --pp-layout)
    places the transformer blocks only, each once."""
    cfg = get_model_config(model)
    layers = deepseek.layers(cfg)
    for stages in (2, 4):
        counts = pipeline.block_counts(layers, stages)
        assert sum(counts) == cfg.num_layers and len(counts) == stages and min(counts) >= 1, counts
    assert pipeline.block_counts(layers, 2, f"{cfg.num_layers - 1},1") == [cfg.num_layers - 1, 1]
    with pytest.raises(UserError, match=f"the model has {cfg.num_layers}"):
        pipeline.block_counts(layers, 2, f"{cfg.num_layers},1")


def test_pipeline_stages_balance_the_experts_a_token_runs_through():
    """A step's time follows the 8 experts of 256 a token runs, not all 256: weighed so, the head
    and MTP layer are 4 blocks' worth, and the last stage gets fewer blocks than the others."""
    cfg = get_model_config("deepseek-v3")
    layers = deepseek.layers(cfg)
    share = flops.expert_share(cfg)
    assert share == cfg.top_k / cfg.num_experts
    (_, by_all), (_, by_active) = pipeline.layer_costs(layers), pipeline.layer_costs(layers, share)
    assert by_active > 3 * by_all
    counts = pipeline.block_counts(layers, 16, expert_share=share)
    assert sum(counts) == cfg.num_layers and counts[-1] < min(counts[1:-1]), counts


def test_print_plan_names_the_mtp_layer_on_the_last_stage(capsys):
    from dtrain.inspect.describe import print_plan
    from tests.layouts import resolved

    print_plan(resolved(["--model", "tiny-mla", "--mesh", "pp=2", "--print-plan", "--world-size", "2"], 2))
    stages = capsys.readouterr().out.split("pp rank")[1].splitlines()[1:3]
    assert "embedding + blocks 0-2" in stages[0] and "block 3 + MTP + head" in stages[1], stages


def test_a_checkpoint_without_fields_added_since_counts_them_at_their_defaults():
    saved = {"dim": 64, "num_experts": 8}
    current = {"dim": 64, "num_experts": 8, "num_expert_groups": 1, "routed_scaling_factor": 1.0}
    defaults = {"num_expert_groups": 1, "routed_scaling_factor": 1.0}
    assert shape_difference(saved, current, defaults) == []
    assert shape_difference(saved, {**current, "num_expert_groups": 2}, defaults) == ["num_expert_groups"]
    assert shape_difference(saved, current) == ["num_expert_groups", "routed_scaling_factor"]
