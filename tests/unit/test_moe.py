"""The mixture-of-experts core: routing, dispatch with and without capacity, the grouped expert
GEMM, router losses and their straight-through gradient, auxiliary-loss-free bias balancing, the
MoE model forward and the presets' sizes. Every reference here is written per token, by hand."""

from __future__ import annotations

import math
import types

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dtrain.metrics import router_scalars
from models import flops, mixtral, moe, spec
from models.config import MoEConfig
from models.context import LocalContext, grouped_swiglu
from models.errors import UserError
from models.presets import get_model_config


CFG = MoEConfig(dim=16, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=32,
                num_experts=6, top_k=2, expert_ffn_dim=24)


def _moe_params(cfg: MoEConfig, seed: int = 0) -> dict:
    specs = moe.moe_params(cfg, std=0.3, out_std=0.3)
    return spec.unflatten({path: spec.init_value(s, seed, path).requires_grad_(s.trainable)
                           for path, s in spec.flatten(specs)})


def _expert(x: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    return w_down @ (F.silu(w_gate @ x) * (w_up @ x))


def _hand_route(x: torch.Tensor, router: torch.Tensor, cfg: MoEConfig, bias=None):
    """Per token: scores, the top-k by (score + bias), their unbiased (renormalised) scores."""
    choices = []
    x, router = x.detach(), router.detach()
    for row in x:
        logits = [float(router[e] @ row) for e in range(cfg.num_experts)]
        if cfg.score_func == "softmax":
            top = max(logits)
            exps = [math.exp(v - top) for v in logits]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        keys = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        chosen = sorted(range(cfg.num_experts), key=lambda e: -keys[e])[:cfg.top_k]
        weights = [scores[e] for e in chosen]
        if cfg.route_norm:
            weights = [w / sum(weights) for w in weights]
        choices.append((chosen, weights, scores))
    return choices


@pytest.mark.parametrize("score_func,route_norm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_route_matches_hand_computation(score_func, route_norm):
    cfg = attrs.evolve(CFG, score_func=score_func, route_norm=route_norm)
    torch.manual_seed(0)
    x, router = torch.randn(10, cfg.dim), torch.randn(cfg.num_experts, cfg.dim)
    routing = moe.route(x, router, cfg)
    for t, (chosen, weights, scores) in enumerate(_hand_route(x, router, cfg)):
        assert routing.expert_ids[t].tolist() == chosen
        torch.testing.assert_close(routing.weights[t], torch.tensor(weights), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(routing.scores[t], torch.tensor(scores), rtol=1e-5, atol=1e-6)


def test_selection_bias_changes_the_choice_not_the_weights():
    torch.manual_seed(1)
    x, router = torch.randn(40, CFG.dim), torch.randn(CFG.num_experts, CFG.dim)
    bias = torch.tensor([0.5, -0.5, 0.0, 0.3, -0.2, 0.0])
    plain, biased = moe.route(x, router, CFG), moe.route(x, router, CFG, bias)
    assert not torch.equal(plain.expert_ids, biased.expert_ids)
    for t, (chosen, weights, _) in enumerate(_hand_route(x, router, CFG, bias)):
        assert biased.expert_ids[t].tolist() == chosen
        # The weights are the unbiased scores of the chosen experts.
        torch.testing.assert_close(biased.weights[t], torch.tensor(weights), rtol=1e-5, atol=1e-6)


def test_forced_load_balance_gives_every_expert_the_same_load_and_keeps_the_router_trained():
    cfg = attrs.evolve(CFG, force_load_balance=True)
    torch.manual_seed(2)
    x, router = torch.randn(12, cfg.dim), torch.randn(cfg.num_experts, cfg.dim, requires_grad=True)
    routing = moe.route(x, router, cfg)
    load = torch.bincount(routing.expert_ids.flatten(), minlength=cfg.num_experts)
    assert load.tolist() == [12 * cfg.top_k // cfg.num_experts] * cfg.num_experts
    assert all(len(set(row)) == cfg.top_k for row in routing.expert_ids.tolist())
    for t, (_, _, scores) in enumerate(_hand_route(x, router, cfg)):
        chosen = [scores[e] for e in routing.expert_ids[t].tolist()]
        torch.testing.assert_close(routing.weights[t], torch.tensor(chosen) / sum(chosen), rtol=1e-5, atol=1e-6)
    routing.weights[:, 0].sum().backward()
    assert router.grad is not None and router.grad.abs().sum() > 0


def _reference_moe(p: dict, x_TD: torch.Tensor, cfg: MoEConfig, kept=None) -> torch.Tensor:
    """A dense loop: each token through each of its kept top-k experts, weighted, plus shared."""
    ex = p["experts"]
    out = torch.zeros_like(x_TD)
    bias = p.get("router_bias")
    for t, (chosen, weights, _) in enumerate(_hand_route(x_TD, p["router"], cfg, bias)):
        for e, w in zip(chosen, weights):
            if kept is None or (t, e) in kept:
                out[t] += w * _expert(x_TD[t], ex["w_gate"][e], ex["w_up"][e], ex["w_down"][e])
        if "shared" in p:
            sh = p["shared"]
            out[t] += _expert(x_TD[t], sh["w_gate"], sh["w_up"], sh["w_down"])
    return out


@pytest.mark.parametrize("changes", [{}, {"num_shared_experts": 2}, {"score_func": "sigmoid", "top_k": 3},
                                     {"bias_update_rate": 1e-3}])
def test_dropless_output_equals_per_token_loop(changes):
    cfg = attrs.evolve(CFG, **changes)
    p = _moe_params(cfg)
    if "router_bias" in p:
        p["router_bias"].copy_(torch.linspace(-0.2, 0.2, cfg.num_experts))
    torch.manual_seed(2)
    x = torch.randn(2, 7, cfg.dim)
    out = moe.moe_forward(p, x, cfg, LocalContext())
    with torch.no_grad():
        torch.testing.assert_close(out, _reference_moe(p, x.view(-1, cfg.dim), cfg).view_as(x),
                                   rtol=1e-4, atol=1e-5)


def test_grouped_gemm_equals_the_expert_loop():
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm")
    torch.manual_seed(3)
    counts = torch.tensor([3, 0, 5, 1, 7, 0])  # empty groups included
    e, f, d = len(counts), 24, 16
    x = torch.randn(int(counts.sum()), d)
    weights = [torch.randn(e, f, d) * 0.3, torch.randn(e, f, d) * 0.3, torch.randn(e, d, f) * 0.3]
    grad_out = torch.randn(x.shape[0], d)  # a contiguous gradient: the CPU kernel needs one
    results = []
    for use_grouped_mm in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x, *weights)]
        try:
            out = grouped_swiglu(inputs[0], counts, *inputs[1:], use_grouped_mm=use_grouped_mm)
        except RuntimeError as error:
            pytest.skip(f"grouped_mm does not run on CPU fp32 here: {error}")
        out.backward(grad_out)
        results.append([out, *(t.grad for t in inputs)])
    for grouped, loop in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    # The kernel's backward rejects zero-stride gradients; the seam must not pass them on.
    grads = []
    for use_grouped_mm in (True, False):
        x_in = x.clone().requires_grad_()
        grouped_swiglu(x_in, counts, *weights, use_grouped_mm=use_grouped_mm).sum().backward()
        grads.append(x_in.grad)
    torch.testing.assert_close(*grads, rtol=1e-5, atol=1e-5)


def test_grouped_swiglu_of_no_rows_gives_zero_weight_gradients():
    """A rank whose experts no token chose: an empty output, and zero (not missing) gradients for
    every weight, with the grouped GEMM asked for (its backward rejects empty inputs)."""
    e, f, d = 4, 24, 16
    weights = [(torch.randn(e, f, d) * 0.3).requires_grad_(), (torch.randn(e, f, d) * 0.3).requires_grad_(),
               (torch.randn(e, d, f) * 0.3).requires_grad_()]
    for upstream in ("sum", "dense"):  # a zero-stride gradient (that of out.sum()) and a dense one
        x = torch.randn(0, d, requires_grad=True)
        out = grouped_swiglu(x, torch.zeros(e, dtype=torch.long), *weights, use_grouped_mm=True)
        assert out.shape == (0, d)
        out.sum().backward() if upstream == "sum" else out.backward(torch.randn(0, d))
        for weight in weights:
            assert weight.grad is not None and weight.grad.shape == weight.shape and not weight.grad.any()
            weight.grad = None


def test_capacity_drops_the_lowest_scores_and_they_add_nothing():
    cfg = attrs.evolve(CFG, capacity_factor=0.5)
    p = _moe_params(cfg, seed=4)
    with torch.no_grad():  # a skewed router, so some experts overflow
        p["router"][0] += 0.8
    torch.manual_seed(4)
    x_TD = torch.randn(24, cfg.dim)
    capacity = math.ceil(0.5 * 24 * cfg.top_k / cfg.num_experts)
    routing = moe.route(x_TD, p["router"], cfg)
    dispatched = moe.dispatch(routing, moe.expert_load(routing, cfg.num_experts), moe.expert_capacity(cfg, 24))

    hand = _hand_route(x_TD, p["router"], cfg)
    kept, num_dropped = set(), 0
    for e in range(cfg.num_experts):
        mine = sorted((-scores[e], t) for t, (chosen, _, scores) in enumerate(hand) if e in chosen)
        num_dropped += max(0, len(mine) - capacity)
        kept.update((t, e) for _, t in mine[:capacity])
        assert dispatched.counts[e] == min(len(mine), capacity)
    assert num_dropped > 0
    assert int(dispatched.num_dropped) == num_dropped
    assert int(dispatched.counts.sum()) == 24 * cfg.top_k - num_dropped

    out = moe.moe_forward(p, x_TD[None], cfg, LocalContext())[0]
    with torch.no_grad():
        torch.testing.assert_close(out, _reference_moe(p, x_TD, cfg, kept), rtol=1e-4, atol=1e-5)
    stats = moe.RouterStats()
    moe.moe_forward(p, x_TD[None], cfg, LocalContext(), aux=types.SimpleNamespace(router_stats=stats))
    assert router_scalars(stats)["moe/dropped_fraction"] == pytest.approx(num_dropped / (24 * cfg.top_k))


def test_aux_and_z_losses_match_their_formulas():
    torch.manual_seed(5)
    x, router = torch.randn(30, CFG.dim), torch.randn(CFG.num_experts, CFG.dim)
    routing = moe.route(x, router, CFG)
    load = torch.bincount(routing.expert_ids.flatten(), minlength=CFG.num_experts)
    hand = _hand_route(x, router, CFG)
    expected = 0.0
    for e in range(CFG.num_experts):
        f_e = sum(e in chosen for chosen, _, _ in hand) / (30 * CFG.top_k)
        p_e = sum(scores[e] for _, _, scores in hand) / 30
        expected += CFG.num_experts * f_e * p_e
    assert moe.load_balancing_loss(routing, load, "softmax").item() == pytest.approx(expected, rel=1e-5)
    logits = x @ router.T
    z = sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in logits) / 30
    assert moe.router_z_loss(routing).item() == pytest.approx(z, rel=1e-5)


def test_router_losses_reach_the_gradient_straight_through():
    cfg = attrs.evolve(CFG, aux_loss_coef=0.3, z_loss_coef=0.05, num_shared_experts=1)
    torch.manual_seed(6)
    x = torch.randn(2, 5, cfg.dim)
    tokens = 10
    p = _moe_params(cfg)
    # loss_scale 1/T: the router losses enter as coef * loss, not summed over the tokens.
    out = moe.moe_forward(p, x, cfg, LocalContext(), aux=types.SimpleNamespace(loss_scale=1 / tokens))
    grad_through, = torch.autograd.grad(out.sum(), p["router"])

    no_losses = attrs.evolve(cfg, aux_loss_coef=0.0, z_loss_coef=0.0)
    out_plain = moe.moe_forward(p, x, no_losses, LocalContext())
    routing = moe.route(x.view(tokens, -1), p["router"], cfg)
    load = torch.bincount(routing.expert_ids.flatten(), minlength=cfg.num_experts)
    explicit = (out_plain.sum() + 0.3 * moe.load_balancing_loss(routing, load, "softmax")
                + 0.05 * moe.router_z_loss(routing))
    grad_explicit, = torch.autograd.grad(explicit, p["router"], retain_graph=True)
    grad_plain, = torch.autograd.grad(out_plain.sum(), p["router"])
    torch.testing.assert_close(out, out_plain)  # forward values are unchanged
    torch.testing.assert_close(grad_through, grad_explicit, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grad_through, grad_plain, atol=1e-4)


def test_bias_update_moves_towards_balance_without_touching_the_weights():
    cfg = attrs.evolve(CFG, bias_update_rate=0.01, aux_loss_coef=0.0)
    p = _moe_params(cfg, seed=7)
    with torch.no_grad():
        p["router"][2] += 0.5  # expert 2 is overloaded
    torch.manual_seed(7)
    x = torch.randn(1, 64, cfg.dim)
    stats = moe.RouterStats()
    out = moe.moe_forward(p, x, cfg, LocalContext(), layer=3, aux=types.SimpleNamespace(router_stats=stats))
    out.sum().backward()
    assert p["router_bias"].grad is None and p["router"].grad is not None

    load = stats.load[3]
    before = moe.route(x[0], p["router"], cfg, p["router_bias"])
    moe.update_expert_bias({"blocks.3.moe.router_bias": p["router_bias"]}, stats, cfg.bias_update_rate)
    bias = p["router_bias"].detach()
    assert bias[2] == pytest.approx(-0.01)
    torch.testing.assert_close(bias, 0.01 * torch.sign(load.mean() - load))
    assert (bias[load > load.mean()] < 0).all() and (bias[load < load.mean()] > 0).all()
    after = moe.route(x[0], p["router"], cfg, p["router_bias"])
    # Where a token's choice is unchanged, so are its weights: the bias only selects.
    same = (before.expert_ids == after.expert_ids).all(-1)
    assert same.any()
    torch.testing.assert_close(before.weights[same], after.weights[same])
    # And balance improves over repeated updates.
    imbalance = [load.max() / load.mean()]
    for _ in range(30):
        stats.reset()
        moe.moe_forward(p, x, cfg, LocalContext(), layer=3, aux=types.SimpleNamespace(router_stats=stats))
        moe.update_expert_bias({"blocks": {"3": {"moe": p}}}, stats, cfg.bias_update_rate)
        imbalance.append(stats.load[3].max() / stats.load[3].mean())
    assert min(imbalance[-5:]) < imbalance[0]


def _init_params(cfg: MoEConfig) -> dict:
    return spec.unflatten({
        f"{layer.name}.{path}": spec.init_value(s, 0, f"{layer.name}.{path}").requires_grad_(s.trainable)
        for layer in mixtral.layers(cfg) for path, s in spec.flatten(layer.params)
    })


@pytest.mark.parametrize("changes", [{}, {"num_shared_experts": 1, "first_dense_layers": 1, "dense_ffn_dim": 96,
                                          "bias_update_rate": 1e-3, "capacity_factor": 1.0, "z_loss_coef": 1e-3},
                                     {"moe_layer_step": 2, "dense_layers": (3,), "dense_ffn_dim": 96}])
def test_tiny_moe_forward_loss_and_gradients(changes):
    cfg = attrs.evolve(get_model_config("tiny-moe"), **changes)
    params = _init_params(cfg)
    torch.manual_seed(8)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    labels = torch.randint(0, cfg.vocab_size, (2, 32))
    stats = moe.RouterStats()
    loss = mixtral.forward(params, tokens, labels, cfg, LocalContext(), stats) / tokens.numel()
    assert torch.isfinite(loss) and abs(loss.item() - math.log(cfg.vocab_size)) < 1.0
    loss.backward()
    trainable = {f"{layer.name}.{path}": s.trainable for layer in mixtral.layers(cfg)
                 for path, s in spec.flatten(layer.params)}
    for path, value in spec.flatten(params):
        if trainable[path]:
            assert value.grad is not None and value.grad.abs().sum() > 0, path
        else:
            assert value.grad is None, path
    assert sorted(stats.load) == list(cfg.moe_layers) and all("moe" in params["blocks"][str(i)] for i in cfg.moe_layers)
    scalars = router_scalars(stats)
    assert scalars["moe/imbalance_max"] >= 1.0 and math.isfinite(scalars["moe/aux_loss"])


def test_recompute_does_not_count_routing_twice():
    cfg = get_model_config("tiny-moe")
    layer = mixtral.layers(cfg)[1]
    p = {path: spec.init_value(s, 0, path).requires_grad_() for path, s in spec.flatten(layer.params)}
    p = spec.unflatten(p)
    x = torch.randn(2, 8, cfg.dim, requires_grad=True)
    grads, loads = [], []
    for recompute in (False, True):
        stats = moe.RouterStats()
        aux = mixtral.make_aux(cfg, torch.arange(8), router_stats=stats)
        if recompute:
            out = checkpoint(layer.forward, p, x, aux, LocalContext(), use_reentrant=False)
        else:
            out = layer.forward(p, x, aux, LocalContext())
        grads.append(torch.autograd.grad((out * out).sum(), p["moe"]["router"])[0])
        loads.append(stats.load[0])
    torch.testing.assert_close(grads[0], grads[1])
    assert torch.equal(loads[0], loads[1]) and loads[0].sum() == 2 * 8 * cfg.top_k


@pytest.mark.parametrize("name,total,active,tolerance", [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
    ("mixtral-8x22b", 141e9, 39e9, 0.01),
    # Published as 16.4B / 2.8B, rounded to one decimal: 2.83B is 1.0% over.
    ("deepseek-moe-16b", 16.4e9, 2.8e9, 0.02),
])
def test_preset_parameter_counts_match_the_published_ones(name, total, active, tolerance):
    cfg = get_model_config(name)
    assert spec.count_params(mixtral.layers(cfg)) == pytest.approx(total, rel=tolerance)
    assert flops.active_params(cfg) == pytest.approx(active, rel=tolerance)


def test_mixtral_flops_count_only_active_experts():
    cfg = get_model_config("mixtral-8x7b")
    d, f, kv = 4096, 14336, 8 * 128
    per_layer = 2 * d * d + 2 * d * kv + 2 * 3 * d * f + 8 * d  # attention, 2 of 8 experts, router
    assert flops.matmul_params(cfg) == 32 * per_layer + 32000 * d
    assert flops.flops_per_token(cfg, 4096) == 6 * flops.matmul_params(cfg) + 12 * 32 * d * 4096
    small_total, small_active = spec.count_params(mixtral.layers(get_model_config("mixtral-small"))), \
        flops.active_params(get_model_config("mixtral-small"))
    assert (round(small_total / 1e9, 2), round(small_active / 1e9, 2)) == (6.74, 1.91)  # as its comment says


@pytest.mark.parametrize("changes,words", [
    ({"top_k": 7}, "top_k=7"),
    ({"num_experts": 0}, "num_experts=0"),
    ({"score_func": "relu"}, "score_func='relu'"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef=-1.0"),
    ({"first_dense_layers": 1, "num_layers": 2}, "dense_ffn_dim"),
    ({"first_dense_layers": 1, "num_layers": 1, "dense_ffn_dim": 8}, "no MoE layer"),
    ({"num_kv_heads": 3, "num_heads": 2}, "num_kv_heads=3"),
    ({"moe_layer_step": 0}, "moe_layer_step=0 must be >= 1"),
    ({"moe_layer_step": 5, "num_layers": 4}, "no MoE layer"),
    ({"dense_layers": (1, 2, 3, 0), "num_layers": 4, "dense_ffn_dim": 8}, "no MoE layer"),
    ({"dense_layers": (4,), "num_layers": 4, "dense_ffn_dim": 8}, "distinct blocks of 0 .. 3"),
    ({"dense_layers": (1, 1), "num_layers": 4, "dense_ffn_dim": 8}, "distinct blocks"),
    ({"dense_layers": (1,), "num_layers": 4}, "dense_ffn_dim >= 1"),
])
def test_invalid_configs_raise_user_errors(changes, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(")):
        attrs.evolve(CFG, **changes)


def test_one_layer_rule_places_the_moe_blocks_of_each_family():
    """Block i is MoE iff i >= first_dense_layers, (i + 1) % moe_layer_step == 0 and i is not in
    dense_layers: DeepSeek's dense prefix, Qwen3-MoE's decoder_sparse_step and mlp_only_layers,
    Llama 4's interleave step, from the command line too."""
    base = attrs.evolve(CFG, num_layers=8, dense_ffn_dim=32)
    assert base.moe_layers == tuple(range(8))
    assert attrs.evolve(base, first_dense_layers=3).moe_layers == (3, 4, 5, 6, 7)
    assert attrs.evolve(base, moe_layer_step=2).moe_layers == (1, 3, 5, 7)  # Llama 4 Maverick's step 2
    assert attrs.evolve(base, moe_layer_step=3, dense_layers=[5]).moe_layers == (2,)
    assert attrs.evolve(base, dense_layers=(0, 7)).moe_layers == (1, 2, 3, 4, 5, 6)
    cfg = get_model_config("tiny-moe", "dense_layers=[0,2],dense_ffn_dim=48,top_k=1")
    assert (cfg.dense_layers, cfg.moe_layers, cfg.top_k) == ((0, 2), (1, 3), 1)
    assert [("moe" in layer.params, "mlp" in layer.params) for layer in mixtral.layers(cfg)[1:-1]] == [
        (False, True), (True, False), (False, True), (True, False)]
    assert get_model_config("tiny-moe", "dense_layers=[]").dense_layers == ()
    with pytest.raises(UserError, match=r"'0' is not a valid tuple\[int, ...\]"):
        get_model_config("tiny-moe", "dense_layers=0,2")


def test_checkpoints_record_the_layer_rule_and_head_dim_as_json_and_older_ones_read_as_the_defaults():
    import json

    from dtrain.checkpoint.storage import model_shape, shape_defaults, shape_difference

    cfg = get_model_config("tiny-moe", "dense_layers=[0],dense_ffn_dim=48,moe_layer_step=2,head_dim=32")
    saved = json.loads(json.dumps(model_shape(cfg)))
    assert (saved["dense_layers"], saved["head_dim"]) == ([0], 32)
    assert shape_difference(saved, model_shape(cfg), shape_defaults(cfg)) == []
    older = {k: v for k, v in model_shape(CFG).items() if k not in ("dense_layers", "moe_layer_step", "head_dim")}
    assert shape_difference(older, model_shape(CFG), shape_defaults(CFG)) == []
    assert shape_difference(older, model_shape(attrs.evolve(CFG, dense_layers=[0], num_layers=2, dense_ffn_dim=8)),
                            shape_defaults(CFG)) == ["num_layers", "dense_ffn_dim", "dense_layers"]


def test_overrides_reach_moe_fields():
    cfg = get_model_config("tiny-moe", "capacity_factor=1.25,score_func=sigmoid,route_norm=false,top_k=3")
    assert (cfg.capacity_factor, cfg.score_func, cfg.route_norm, cfg.top_k) == (1.25, "sigmoid", False, 3)
    assert get_model_config("tiny-moe", "capacity_factor=none").capacity_factor is None
    with pytest.raises(UserError, match="top_k=9"):
        get_model_config("tiny-moe", "top_k=9")
    with pytest.raises(UserError, match="cannot override 'ffn_dim'"):
        get_model_config("tiny-moe", "ffn_dim=3")


