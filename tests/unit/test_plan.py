"""The sharding plan: logical axes -> mesh axes -> placements, local shard shapes, the table."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import Replicate, Shard

from models import llama, spec
from models.errors import UserError
from models.presets import get_model_config
from parallel.mesh import MeshSpec
from parallel.plan import DEFAULT_PARAM_RULES, Plan, resolve


R = Replicate()

# --- resolve under the default rules ---------------------------------------------------------


@pytest.mark.parametrize(
    "axes, expected",
    [
        (("vocab", "embed"), (R, Shard(0))),       # embedding / output head: vocab-parallel
        (("heads", "embed"), (R, Shard(0))),       # wq: column-parallel
        (("embed", "heads"), (R, Shard(1))),       # wo: row-parallel
        (("kv_heads", "embed"), (R, Shard(0))),    # wk, wv
        (("mlp", "embed"), (R, Shard(0))),         # w_gate, w_up
        (("embed", "mlp"), (R, Shard(1))),         # w_down
        (("embed",), (R, R)),                      # norms: replicated
    ],
)
def test_resolve_default_rules_tp(axes, expected):
    # dp_shard is listed to show that an axis no rule names stays Replicate.
    assert resolve(axes, DEFAULT_PARAM_RULES, ("dp_shard", "tp")) == expected


def test_resolve_expert_over_ep_and_mlp_over_tp():
    assert resolve(("expert", "embed", "mlp"), DEFAULT_PARAM_RULES, ("ep", "tp")) == (Shard(0), Shard(2))
    assert resolve(("expert", "mlp", "embed"), DEFAULT_PARAM_RULES, ("ep", "tp")) == (Shard(0), Shard(1))
    # Without an ep dim on the mesh the expert dim is not split.
    assert resolve(("expert", "embed", "mlp"), DEFAULT_PARAM_RULES, ("tp",)) == (Shard(2),)


def test_resolve_missing_mesh_axis_is_skipped():
    # tp not on this mesh (size 1): every placement stays Replicate.
    assert resolve(("heads", "embed"), DEFAULT_PARAM_RULES, ("dp_shard",)) == (R,)
    assert resolve(("heads", "embed"), DEFAULT_PARAM_RULES, ()) == ()


def test_resolve_tuple_mapping_splits_one_dim_over_two_mesh_axes():
    rules = {**DEFAULT_PARAM_RULES, "mlp": ("cp", "tp")}
    assert resolve(("mlp", "embed"), rules, ("cp", "tp")) == (Shard(0), Shard(0))
    assert resolve(("embed", "mlp"), rules, ("cp", "tp")) == (Shard(1), Shard(1))
    # Only the axes present on the mesh apply.
    assert resolve(("mlp", "embed"), rules, ("tp",)) == (Shard(0),)


def test_resolve_none_axis_is_unsplit():
    assert resolve((None, "vocab"), DEFAULT_PARAM_RULES, ("tp",)) == (Shard(1),)


def test_resolve_two_dims_on_one_mesh_axis_raises():
    with pytest.raises(UserError, match="tp"):
        resolve(("heads", "mlp"), DEFAULT_PARAM_RULES, ("tp",))


# --- Plan: mesh dims, overrides, errors ------------------------------------------------------


def _plan(text: str, world: int, **kwargs) -> Plan:
    return Plan.build(MeshSpec.parse(text, world), **kwargs)


def test_param_mesh_dims_leave_out_size_one_axes():
    assert _plan("dp=2,tp=4", 8).param_mesh_dims == ("tp",)
    assert _plan("dp=8", 8).param_mesh_dims == ()
    assert _plan("dp=4,cp=2", 8).param_mesh_dims == ()   # cp is not a parameter axis by default
    plan = _plan("dp=8", 8)
    assert plan.param_placements(("heads", "embed")) == ()
    assert plan.param_placements(("embed",)) == ()


def test_param_placements_fsdp_tp():
    plan = _plan("dp=2,tp=4", 8)
    assert plan.param_placements(("heads", "embed")) == (Shard(0),)
    assert plan.param_placements(("embed", "mlp")) == (Shard(1),)
    assert plan.param_placements(("embed",)) == (R,)


def test_rules_split_only_over_model_parallel_axes():
    plan = _plan("dp=2,cp=2,tp=2", 8)
    with pytest.raises(UserError, match="may use only tp, ep"):
        plan.with_rules(params={"mlp": ("cp", "tp")})
    with pytest.raises(UserError, match="may use only tp"):
        plan.with_rules(activations={"residual": {"seq": ("cp", "tp")}})
    # FSDP shards dim 0 over dp_shard x cp = 4, after tp's split: 14336 / 2 / 4 = 1792.
    assert plan.local_shape((14336, 4096), ("mlp", "embed")) == (1792, 4096)
    assert plan.local_shape((4096, 14336), ("embed", "mlp")) == (1024, 7168)
    assert plan.full_placements(("mlp", "embed")) == {"dp_shard": "S(0)", "cp": "S(0)", "tp": "S(0)"}


def test_with_rules_mlp_none_replicates_mlp():
    base = _plan("dp=2,tp=4", 8)
    plan = base.with_rules(params={"mlp": None})
    assert plan.param_placements(("mlp", "embed")) == (R,)
    assert plan.param_placements(("embed", "mlp")) == (R,)
    assert plan.param_placements(("heads", "embed")) == (Shard(0),)   # other rules unchanged
    assert plan.local_shape((14336, 4096), ("mlp", "embed")) == (7168, 4096)  # only FSDP left
    assert plan.full_placements(("mlp", "embed")) == {"dp_shard": "S(0)", "tp": "R"}
    # with_rules returns a copy.
    assert base.param_placements(("mlp", "embed")) == (Shard(0),)
    assert base.param_rules["mlp"] == "tp"


def test_sequence_parallel_via_build_and_with_rules():
    spec_ = MeshSpec.parse("dp=2,tp=4", 8)
    assert not Plan.build(spec_).sequence_parallel
    sp = Plan.build(spec_, sequence_parallel=True)
    assert sp.sequence_parallel
    assert sp.activation_rules["residual"]["seq"] == "tp"
    assert Plan.build(spec_).with_rules(activations={"residual": {"seq": "tp"}}).sequence_parallel
    assert not sp.with_rules(activations={"residual": {"seq": None}}).sequence_parallel
    # Residual activations [batch, seq, embed] are split along seq over tp only with SP.
    assert sp.activation_placements(("batch", "seq", "embed"), "residual") == (Shard(1),)
    assert Plan.build(spec_).activation_placements(("batch", "seq", "embed"), "residual") == (R,)
    assert sp.activation_placements(("batch", "seq", "heads", "head_dim"), "attention") == (Shard(2),)
    assert sp.activation_placements(("batch", "seq", "vocab"), "logits") == (Shard(2),)
    assert "sequence parallel" in sp.describe(llama.layers(get_model_config("tiny")))


def test_sequence_parallel_needs_tp():
    assert not Plan.build(MeshSpec.parse("dp=8", 8), sequence_parallel=True).sequence_parallel


def test_unknown_activation_region_in_model_code():
    with pytest.raises(KeyError, match="nowhere"):
        _plan("tp=2", 2).activation_placements(("batch",), "nowhere")


@pytest.mark.parametrize(
    "kwargs, must_name",
    [
        (dict(params={"hidden": "tp"}), "hidden"),                        # unknown logical axis
        (dict(params={"mlp": "tensor"}), "tensor"),                       # unknown mesh axis
        (dict(params={"mlp": ("tp", "cp")}), "mlp"),                      # tuple in the wrong order
        (dict(params={"vocab": ("tp", "dp_shard")}), "vocab"),
        (dict(activations={"attn": {"seq": "cp"}}), "attn"),             # unknown region
        (dict(activations={"residual": {"sequence": "tp"}}), "sequence"),  # unknown activation axis
        (dict(activations={"residual": {"seq": "sp"}}), "sp"),           # unknown mesh axis
        (dict(activations={"residual": {"seq": ("tp", "cp")}}), "seq"),  # wrong order
    ],
)
def test_with_rules_errors(kwargs, must_name):
    with pytest.raises(UserError) as info:
        _plan("dp=2,cp=2,tp=2", 8).with_rules(**kwargs)
    assert must_name in str(info.value)


def test_sequence_parallel_rule():
    plan = _plan("dp=2,cp=2,tp=2", 8).with_rules(activations={"residual": {"seq": "tp"}})
    assert plan.activation_placements(("batch", "seq", "embed"), "residual") == (Shard(1),)


def test_two_dims_on_one_mesh_axis_through_plan():
    plan = _plan("dp=2,tp=4", 8).with_rules(params={"embed": "tp"})
    with pytest.raises(UserError, match="tp"):
        plan.param_placements(("heads", "embed"))


# --- local shapes and full placements for llama3-8b, by hand -------------------------------

CFG = get_model_config("llama3-8b")
D, FFN, V, KV = 4096, 14336, 128256, 8 * 128   # dim, ffn, vocab, kv_heads x head_dim
assert (CFG.dim, CFG.ffn_dim, CFG.vocab_size, CFG.num_kv_heads * CFG.head_dim) == (D, FFN, V, KV)

# Each parameter of one block (and the embed/head ones): global shape, axes.
SHAPES = {
    "embed.weight": ((V, D), ("vocab", "embed")),
    "attn_norm": ((D,), ("embed",)),
    "attn.wq": ((D, D), ("heads", "embed")),
    "attn.wk": ((KV, D), ("kv_heads", "embed")),
    "attn.wv": ((KV, D), ("kv_heads", "embed")),
    "attn.wo": ((D, D), ("embed", "heads")),
    "mlp_norm": ((D,), ("embed",)),
    "mlp.w_gate": ((FFN, D), ("mlp", "embed")),
    "mlp.w_up": ((FFN, D), ("mlp", "embed")),
    "mlp.w_down": ((D, FFN), ("embed", "mlp")),
    "head.norm": ((D,), ("embed",)),
    "head.output": ((V, D), ("vocab", "embed")),
}

# FSDP over 8 ranks: dim 0 / 8.
FSDP8 = {
    "embed.weight": (16032, D), "attn_norm": (512,), "attn.wq": (512, D), "attn.wk": (128, D),
    "attn.wv": (128, D), "attn.wo": (512, D), "mlp_norm": (512,), "mlp.w_gate": (1792, D),
    "mlp.w_up": (1792, D), "mlp.w_down": (512, FFN), "head.norm": (512,), "head.output": (16032, D),
}
# HSDP 2 x 4: dim 0 / 4 (replicated over dp_replicate).
HSDP = {
    "embed.weight": (32064, D), "attn_norm": (1024,), "attn.wq": (1024, D), "attn.wk": (256, D),
    "attn.wv": (256, D), "attn.wo": (1024, D), "mlp_norm": (1024,), "mlp.w_gate": (3584, D),
    "mlp.w_up": (3584, D), "mlp.w_down": (1024, FFN), "head.norm": (1024,), "head.output": (32064, D),
}
# FSDP 2 x TP 4: the TP split first (column dims / 4 on dim 0, row dims / 4 on dim 1), then dim 0 / 2.
FSDP_TP = {
    "embed.weight": (V // 4 // 2, D), "attn_norm": (D // 2,), "attn.wq": (D // 4 // 2, D),
    "attn.wk": (KV // 4 // 2, D), "attn.wv": (KV // 4 // 2, D), "attn.wo": (D // 2, D // 4),
    "mlp_norm": (D // 2,), "mlp.w_gate": (FFN // 4 // 2, D), "mlp.w_up": (FFN // 4 // 2, D),
    "mlp.w_down": (D // 2, FFN // 4), "head.norm": (D // 2,), "head.output": (V // 4 // 2, D),
}
assert FSDP_TP["attn.wq"] == (512, 4096) and FSDP_TP["attn.wo"] == (2048, 1024)
assert FSDP_TP["mlp.w_down"] == (2048, 3584) and FSDP_TP["embed.weight"] == (16032, 4096)

TP_COLUMN = {"embed.weight", "attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up", "head.output"}
TP_ROW = {"attn.wo", "mlp.w_down"}


@pytest.mark.parametrize("name", list(SHAPES))
def test_fsdp_local_shape_and_placements(name):
    plan = _plan("dp=8", 8)
    shape, axes = SHAPES[name]
    assert plan.local_shape(shape, axes) == FSDP8[name]
    assert plan.full_placements(axes) == {"dp_shard": "S(0)"}


@pytest.mark.parametrize("name", list(SHAPES))
def test_hsdp_local_shape_and_placements(name):
    plan = _plan("dp_replicate=2,dp_shard=4", 8)
    shape, axes = SHAPES[name]
    assert plan.local_shape(shape, axes) == HSDP[name]
    assert plan.full_placements(axes) == {"dp_replicate": "R", "dp_shard": "S(0)"}
    assert list(plan.full_placements(axes)) == ["dp_replicate", "dp_shard"]   # mesh order


@pytest.mark.parametrize("name", list(SHAPES))
def test_fsdp_tp_local_shape_and_placements(name):
    plan = _plan("dp=2,tp=4", 8)
    shape, axes = SHAPES[name]
    assert plan.local_shape(shape, axes) == FSDP_TP[name]
    tp = "S(0)" if name in TP_COLUMN else "S(1)" if name in TP_ROW else "R"
    assert plan.full_placements(axes) == {"dp_shard": "S(0)", "tp": tp}
    assert list(plan.full_placements(axes)) == ["dp_shard", "tp"]


def test_single_device_plan_is_unsharded():
    plan = _plan("", 1)
    assert plan.local_shape((V, D), ("vocab", "embed")) == (V, D)
    assert plan.full_placements(("vocab", "embed")) == {}


def test_uneven_split_rounds_up():
    plan = _plan("dp=3", 3)
    assert plan.local_shape((D,), ("embed",)) == (math.ceil(4096 / 3),) == (1366,)


def _expected_local(plan_name: str, path: str) -> tuple[int, ...]:
    table = {"fsdp": FSDP8, "hsdp": HSDP, "fsdp_tp": FSDP_TP}[plan_name]
    if path in table:
        return table[path]
    return table[path.split(".", 2)[2]]   # blocks.N.<path>


@pytest.mark.parametrize(
    "plan_name, text",
    [("fsdp", "dp=8"), ("hsdp", "dp_replicate=2,dp_shard=4"), ("fsdp_tp", "dp=2,tp=4")],
)
def test_describe_one_row_per_parameter(plan_name, text):
    layers = llama.layers(CFG)
    plan = _plan(text, 8)
    table = plan.describe(layers)
    lines = table.splitlines()
    names = [f"{layer.name}.{path}" for layer in layers for path, _ in spec.flatten(layer.params)]
    assert len(names) == 1 + 32 * 9 + 2
    for name in names:
        rows = [line for line in lines if line.split() and line.split()[0] == name]
        assert len(rows) == 1, (name, rows)
        cells = rows[0].split()
        local = _expected_local(plan_name, name)
        assert cells[-1] == "x".join(map(str, local)), (name, rows[0])
        param = dict(spec.flatten(layers[0].params if name.startswith("embed") else
                                  layers[-1].params if name.startswith("head") else layers[1].params))
        short = name.split(".", 1)[1] if not name.startswith("blocks") else name.split(".", 2)[2]
        assert cells[-2] == "x".join(map(str, param[short].shape))
        assert ",".join(param[short].axes) in cells
    assert "world size 8" in lines[0]


def test_describe_lists_tied_parameter():
    layers = llama.layers(get_model_config("llama3.2-1b"))
    table = _plan("dp=2", 2).describe(layers)
    tied_rows = [line for line in table.splitlines() if line.startswith("head.output")]
    assert len(tied_rows) == 1
    assert "tied to" in tied_rows[0] and "embed.weight" in tied_rows[0]
