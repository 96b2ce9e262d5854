"""FP8 all-gather under FSDP (tensorwise): which weights are gathered in float8 for which recipe,
mesh and device; the float8 path through forward, backward and the optimizer on CPU with a fake
process group; the scales' one all-reduce and checkpoints over two gloo ranks; and, marked gpu,
the real float8 all-gather over NCCL on two GPUs (eager and compiled) against bf16 all-gather
and plain bf16."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from models import families
from models.presets import get_model_config
from parallel import precision
from parallel.layout import FP8Layout, ParallelLayout
from parallel.mesh import MeshSpec, build_meshes
from parallel.parallelize import parallelize
from parallel.plan import Plan
from tests.launch import run_cli, scalars

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


def _two_rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Scales from the one all-reduce match each weight's global amax on every rank; a checkpoint
    of float8-gathered weights loads into bf16-gathered ones and back (DCP sees plain values)."""
    from dtrain.checkpoint import train_state
    from dtrain.config import OptimArgs
    from dtrain.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # gloo cannot move float8: nothing here all-gathers (no forward), it only reduces fp32.
        precision.FLOAT8_COLLECTIVE_DEVICES = ("cuda", "cpu")
        results: dict = {}

        def build(float8_all_gather: bool, seed: int):
            _, model, _ = _build("tiny", "dp=2", "tensorwise", {1, 2}, float8_all_gather=float8_all_gather)
            optimizer = build_optimizer([model], OptimArgs())
            generator = torch.Generator().manual_seed(seed + rank)
            for p in model.parameters():
                p.grad = DTensor.from_local(torch.randn(p.to_local().shape, generator=generator),
                                            p.device_mesh, p.placements)
            optimizer.step()
            optimizer.zero_grad()
            return model, optimizer

        model, optimizer = build(True, 0)
        precision.after_optimizer_step([model])
        scales = {}
        for name in sorted(_float8_gathered(model)):
            local = model.get_parameter(name)._local_tensor
            amax = local._tensor.abs().max().reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            expected = (torch.finfo(torch.float8_e4m3fn).max / amax.double()).float()[0]
            scales[name] = [local._precomputed_scale.item(), expected.item()]
        results["scales"] = scales

        def shards(m, o):
            params = dict(m.named_parameters())
            local = {n: getattr(p._local_tensor, "_tensor", p._local_tensor).clone() for n, p in params.items()}
            local.update({f"{n}/exp_avg": o.state[p]["exp_avg"].to_local().clone() for n, p in params.items()})
            return local

        root = Path(out_dir)
        for saved_float8, path in ((True, root / "from_float8"), (False, root / "from_bf16")):
            source, source_opt = (model, optimizer) if saved_float8 else build(False, 1)
            train_state.save_train_state(source, source_opt, path, rank=rank)
            target, target_opt = build(not saved_float8, 2)
            expected, before = shards(source, source_opt), shards(target, target_opt)
            train_state.load_train_state(target, target_opt, path, rank=rank, has_optim=True)
            loaded = shards(target, target_opt)
            results[path.name] = {
                "differed_before": sum(not torch.equal(expected[n], before[n]) for n in expected),
                "mismatched": sorted(n for n in expected if not torch.equal(expected[n], loaded[n])),
                "float8_gathered": len(_float8_gathered(target)),
            }
        (root / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fp8_all_gather")
    init_file = tempfile.mktemp(dir=out_dir)
    mp.spawn(_two_rank_worker, args=(2, init_file, str(out_dir)), nprocs=2, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_scales_come_from_the_global_amax_on_every_rank(two_rank_results):
    by_rank = [results["scales"] for results in two_rank_results]
    assert len(by_rank[0]) == 14
    for name, (scale, expected) in by_rank[0].items():
        assert scale == expected, name
        assert by_rank[1][name][0] == scale, name


@pytest.mark.parametrize("direction,float8_gathered", [("from_float8", 0), ("from_bf16", 14)])
def test_checkpoints_move_between_float8_and_bf16_all_gather(two_rank_results, direction, float8_gathered):
    for results in two_rank_results:
        assert results[direction]["differed_before"] > 0
        assert results[direction]["mismatched"] == []
        assert results[direction]["float8_gathered"] == float8_gathered


GPU_ARGS = ["--model", "tiny", "--steps", "8", "--seed", "0", "--precision", "bf16", "--seq-len", "256",
            "--global-batch", "8", "--micro-batch", "4", "--lr", "1e-3"]


@pytest.mark.gpu
def test_float8_all_gather_on_two_gpus(tmp_path):
    """FSDP over 2 GPUs with --fp8 tensorwise: the worker checks that FP8 blocks see float8
    weights from the all-gather, and that the scales were precomputed after each step; the losses
    stay close to bf16 all-gather (the same FP8 matmuls) and to plain bf16."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    runs = {"float8": ["--fp8", "tensorwise"], "float8_compiled": ["--fp8", "tensorwise", "--compile"],
            "bf16_gather": ["--fp8", "tensorwise", "--no-fp8-all-gather"], "bf16": []}
    losses = {}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        args = [*GPU_ARGS, "--mesh", "dp=2", "--run-dir", str(run_dir), *extra]
        result = run_cli([name, *args], nproc=2, module="tests.workers.fp8_all_gather")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        report = json.loads(re.findall(r"^FP8_ALL_GATHER (.*)$", result.stdout, re.M)[-1])
        if name.startswith("float8"):
            assert report["float8_weights"] > 0 and report["bf16_weights"] == 0, report
            assert report["precomputed_steps"] == 8, report
            assert report["scale_errors"] == [], report
        elif name == "bf16_gather":
            assert report["float8_weights"] == 0 and report["bf16_weights"] > 0, report
        losses[name] = scalars(run_dir)["train/loss"]
    assert len(losses["float8"]) == 8
    series = zip(losses["float8"], losses["float8_compiled"], losses["bf16_gather"], losses["bf16"])
    for step, (f8, compiled, bf16_gather, bf16) in enumerate(series, 1):
        # Float8 cast from the fp32 shard vs from the gathered bf16 weight: nearly the same values.
        assert abs(f8 - bf16_gather) <= 0.01 * bf16_gather, (step, f8, bf16_gather)
        assert abs(f8 - compiled) <= 0.01 * f8, (step, f8, compiled)
        assert abs(f8 - bf16) <= 0.05 * bf16, (step, f8, bf16)
