"""FP8 all-gather under FSDP (tensorwise): which weights are gathered in float8 for which recipe,
mesh and device; the float8 path through forward, backward and the optimizer on CPU with a fake
process group; the scales' one all-reduce and checkpoints over two gloo ranks; and, marked gpu,
the real float8 all-gather over NCCL on two GPUs (eager and compiled) against bf16 all-gather
and plain bf16."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from models import families
from models.presets import get_model_config
from parallel import precision
from parallel.layout import FP8Layout, ParallelLayout
from parallel.mesh import MeshSpec, build_meshes
from parallel.parallelize import parallelize
from parallel.plan import Plan


ATTN = ("attn.wq", "attn.wk", "attn.wv", "attn.wo")


MLP = ("mlp.w_gate", "mlp.w_up", "mlp.w_down")


SHARED = ("moe.shared.w_gate", "moe.shared.w_up", "moe.shared.w_down")


def _wrapper_type():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return WeightWithDynamicFloat8CastTensor


@pytest.mark.parametrize("recipe,mesh,device,reason", [
    ("tensorwise", "dp=2", "cuda", None),
    ("tensorwise", "cp=2", "cuda", None),
    ("tensorwise", "dp_replicate=2,dp=2", "cuda", None),
    ("tensorwise", "dp=2,pp=2", "cuda", None),
    ("tensorwise", "dp=2,ep=2", "cuda", None),
    ("tensorwise", "dp=2,tp=2", "cuda", "tp splits"),
    ("tensorwise", "tp=2", "cuda", "tp splits"),
    ("tensorwise", "", "cuda", "one shard"),
    ("tensorwise", "dp_replicate=2", "cuda", "one shard"),
    ("rowwise", "dp=2", "cuda", "per row"),
    ("rowwise_with_gw_hp", "dp=2", "cuda", "per row"),
    ("tensorwise", "dp=2", "cpu", "cannot move float8"),
])
def test_when_weights_are_gathered_in_float8(recipe, mesh, device, reason):
    spec = MeshSpec.parse(mesh, None)
    blocker = precision.float8_all_gather_blocker(recipe, "torchao", True, spec, device)
    if reason is None:
        assert blocker is None
    else:
        assert blocker is not None and reason in blocker


def test_float8_all_gather_can_be_turned_off():
    assert "turned off" in precision.float8_all_gather_blocker("tensorwise", "torchao", False,
                                                               MeshSpec.parse("dp=2", None), "cuda")


@pytest.mark.parametrize("recipe", precision.TORCHAO_RECIPES)
def test_the_recipes_that_gather_float8_are_those_torchao_casts_per_tensor(recipe):
    per_tensor = precision.Float8Linear(recipe, emulate=True).casts_weight_per_tensor
    assert per_tensor == (recipe in precision.PER_TENSOR_WEIGHT_RECIPES)


@pytest.mark.parametrize("axes,matmul", [
    (("heads", "embed"), True), (("embed", "heads"), True), (("kv_heads", "embed"), True),
    (("mlp", "embed"), True), (("embed", "mlp"), True),
    (("embed",), False), (("vocab", "embed"), False), (("router", "embed"), False), (("router",), False),
    (("expert", "expert_mlp", "embed"), False), (("expert", "embed", "expert_mlp"), False),
])
def test_matmul_weights_by_logical_axes(axes, matmul):
    assert precision.is_fp8_matmul_weight(axes) is matmul


@pytest.fixture
def two_fake_ranks(fake_world, monkeypatch):
    """A fake two-rank world: FSDP shards and gathers but no data moves, so the float8
    all-gather runs its casts and hooks on CPU."""
    monkeypatch.setattr(precision, "FLOAT8_COLLECTIVE_DEVICES", ("cuda", "cpu"))
    with fake_world(2):
        yield


def _build(model: str, mesh: str, recipe: str, fp8_blocks: set[int], overrides: dict | None = None,
           float8_all_gather: bool = True):
    cfg = get_model_config(model)
    if overrides:
        cfg = attrs.evolve(cfg, **overrides)
    spec = MeshSpec.parse(mesh, dist.get_world_size())
    plan = Plan.build(spec, sequence_parallel=False, num_kv_heads=cfg.num_kv_heads)
    blocker = precision.float8_all_gather_blocker(recipe, "torchao", float8_all_gather, spec, "cpu")
    layout = ParallelLayout(plan, precision="bf16", fp8=FP8Layout(
        recipe, layers=frozenset(f"blocks.{i}" for i in fp8_blocks), all_gather=blocker is None, emulated=True))
    fp8 = precision.fp8_backend(layout.fp8, torch.device("cpu"))
    model = parallelize(families.layers(cfg), layout, build_meshes(spec, "cpu"), device=torch.device("cpu"), fp8=fp8)
    return cfg, model, fp8


def _float8_gathered(model) -> set[str]:
    wrapper = _wrapper_type()
    return {name for name, p in model.named_parameters()
            if isinstance(p, DTensor) and isinstance(p._local_tensor, wrapper)}


def test_only_the_fp8_blocks_matmul_weights_are_wrapped(two_fake_ranks):
    _, model, fp8 = _build("tiny", "dp=2", "tensorwise", {1, 2})
    assert _float8_gathered(model) == {f"blocks.{i}.{w}" for i in (1, 2) for w in ATTN + MLP}
    assert fp8.config.enable_fsdp_float8_all_gather


def test_moe_wraps_attention_and_shared_experts_not_router_or_experts(two_fake_ranks):
    overrides = dict(num_shared_experts=1, first_dense_layers=1, dense_ffn_dim=128, bias_update_rate=0.001)
    _, model, _ = _build("tiny-moe", "dp=2,ep=2", "tensorwise", {0, 1, 2, 3}, overrides)
    names = {name for name, _ in model.named_parameters()}
    assert any(".router" in n for n in names) and any(".experts." in n for n in names)
    expected = {f"blocks.0.{w}" for w in ATTN + MLP} | {f"blocks.{i}.{w}" for i in (1, 2, 3) for w in ATTN + SHARED}
    assert _float8_gathered(model) == expected


@pytest.mark.parametrize("recipe,mesh,float8_all_gather", [
    ("rowwise", "dp=2", True), ("rowwise_with_gw_hp", "dp=2", True), ("tensorwise", "tp=2", True),
    ("tensorwise", "dp=2", False),
])
def test_bf16_all_gather_where_float8_is_not_allowed(two_fake_ranks, recipe, mesh, float8_all_gather):
    _, model, fp8 = _build("tiny", mesh, recipe, {0, 1, 2, 3}, float8_all_gather=float8_all_gather)
    assert _float8_gathered(model) == set()
    assert not fp8.config.enable_fsdp_float8_all_gather


def test_float8_gathered_weights_go_through_the_fp8_matmul(two_fake_ranks, monkeypatch):
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from dtrain.config import OptimArgs
    from dtrain.optim import build_optimizer

    cfg, model, _ = _build("tiny", "dp=2", "tensorwise", {1, 2})
    weights_seen, precomputed_used = [], []
    call = precision.Float8Linear.__call__
    monkeypatch.setattr(precision.Float8Linear, "__call__",
                        lambda self, x, w: weights_seen.append(type(w)) or call(self, x, w))
    wrapper = _wrapper_type()
    pre_all_gather = wrapper.fsdp_pre_all_gather

    def recording_pre_all_gather(self, mesh):
        precomputed_used.append(self._precomputed_scale is not None)
        return pre_all_gather(self, mesh)

    monkeypatch.setattr(wrapper, "fsdp_pre_all_gather", recording_pre_all_gather)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    aux = attrs.evolve(families.make_aux(cfg, torch.arange(16)), labels=tokens)
    optimizer = build_optimizer([model], OptimArgs())

    model(tokens, aux).backward()
    # 2 FP8 blocks x 7 matmuls; the gathered float8 weight goes to the matmul as it is.
    assert weights_seen == [Float8TrainingTensor] * 14
    assert precomputed_used and not any(precomputed_used)  # no scales yet: each gather reduces its amax
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor) and type(param.grad.to_local()) is torch.Tensor, name
        assert param.grad.to_local().shape == param.to_local().shape, name
    optimizer.step()
    assert len(_float8_gathered(model)) == 14  # the update kept the wrappers

    precision.after_optimizer_step([model])
    for name in _float8_gathered(model):
        local = model.get_parameter(name)._local_tensor
        # The fake world's all-reduce moves nothing: the rank's own amax is the global one here.
        expected = (torch.finfo(torch.float8_e4m3fn).max / local._tensor.abs().max().double()).float()
        assert torch.equal(local._precomputed_scale, expected), name
    precomputed_used.clear()
    model(tokens, aux).backward()
    assert precomputed_used and all(precomputed_used)


def test_after_optimizer_step_is_a_no_op_without_float8_gathered_weights(two_fake_ranks):
    _, model, _ = _build("tiny", "dp=2", "rowwise", {0, 1, 2, 3})
    precision.after_optimizer_step([model])  # no collective, no error
