"""`linear_many`: the q/k/v and gate/up projections as one matmul on whole weights, the same
numbers as separate matmuls; separate matmuls on DTensor and other tensor-subclass weights."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from models.context import LocalContext
from parallel.context import ParallelContext
from parallel.layout import ParallelLayout
from parallel.mesh import MeshSpec, build_meshes
from parallel.plan import Plan


OUTS = (32, 16, 16)


def _inputs(shape=(2, 5, 24)):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weights = [torch.nn.Parameter(torch.randn(out, shape[-1])) for out in OUTS]
    return x, weights


def _fusing(ctx):
    ctx.fuse_projections = True
    return ctx


def _grads(outs, upstream, tensors):
    return torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, upstream)), tensors)


@pytest.mark.parametrize("shape", [(2, 5, 24), (7, 24)])
def test_fused_projections_match_separate_matmuls(shape, monkeypatch):
    x, weights = _inputs(shape)
    ctx = LocalContext()
    ctx.fuse_projections = True
    fused_calls = []
    concatenated = LocalContext._concatenated_linear
    monkeypatch.setattr(LocalContext, "_concatenated_linear",
                        lambda self, x, w: fused_calls.append(len(w)) or concatenated(self, x, w))
    fused = ctx.linear_many(x, weights)
    separate = [F.linear(x, w) for w in weights]
    assert fused_calls == [len(weights)]
    upstream = [torch.randn_like(o) for o in separate]
    for got, expected in zip(fused, separate):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    for got, expected in zip(_grads(fused, upstream, [x, *weights]), _grads(separate, upstream, [x, *weights])):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


def test_fused_projections_give_no_gradient_to_frozen_weights():
    x, weights = _inputs()
    weights[1].requires_grad_(False)
    out = _fusing(LocalContext()).linear_many(x, weights)
    sum(o.sum() for o in out).backward()
    assert weights[1].grad is None and weights[0].grad is not None and x.grad is not None


class _Tagged(torch.Tensor):
    """A tensor subclass, as torchao's float8 weights are."""


def test_tensor_subclass_weights_are_multiplied_one_by_one(monkeypatch):
    x, weights = _inputs()
    monkeypatch.setattr(LocalContext, "_concatenated_linear", lambda *a: pytest.fail("fused a subclass"))
    out = _fusing(LocalContext()).linear_many(x, [weights[0].as_subclass(_Tagged), *weights[1:]])
    for got, w in zip(out, weights):
        torch.testing.assert_close(got.as_subclass(torch.Tensor), F.linear(x, w))


@pytest.fixture
def one_rank_context(fake_world):
    with fake_world(1):
        spec = MeshSpec.parse("", 1)
        meshes = build_meshes(spec, "cpu")
        yield ParallelContext(ParallelLayout(Plan.build(spec), fuse_projections=True), meshes), meshes.world


def test_dtensor_weights_keep_their_own_placements(one_rank_context, monkeypatch):
    ctx, mesh = one_rank_context
    tp_mesh = mesh["tp"]
    x, weights = _inputs()
    # Column-parallel q and k, replicated v (as with fewer KV heads than tp ranks).
    placements = [Shard(0), Shard(0), Replicate()]
    dweights = [distribute_tensor(w.detach(), tp_mesh, [p]) for w, p in zip(weights, placements)]
    dx = distribute_tensor(x.detach(), tp_mesh, [Replicate()])
    monkeypatch.setattr(ParallelContext, "_concatenated_linear", lambda *a: pytest.fail("fused DTensors"))
    out = ctx.linear_many(dx, dweights)
    for got, w, placement in zip(out, weights, placements):
        assert isinstance(got, DTensor)
        assert got.placements == ((Shard(2),) if placement == Shard(0) else (Replicate(),))
        torch.testing.assert_close(got.full_tensor(), F.linear(x, w))


def test_projections_are_separate_matmuls_unless_asked(monkeypatch):
    x, weights = _inputs((2, 5, 24))
    monkeypatch.setattr(LocalContext, "_concatenated_linear", lambda *a: pytest.fail("fused by default"))
    for got, w in zip(LocalContext().linear_many(x, weights), weights):
        torch.testing.assert_close(got, F.linear(x, w), rtol=0, atol=0)


def _train_in_process(tmp_path, extra: list[str]) -> list[dict[str, float]]:
    from dtrain import distributed
    from dtrain.trainer import Trainer
    from tests.launch import TINY_ARGS
    from tests.layouts import resolved

    layout = resolved([*TINY_ARGS, "--steps", "3", "--run-dir", str(tmp_path), *extra])
    runtime = distributed.init_process_group()
    try:
        return Trainer(layout, runtime).fit()
    finally:
        distributed.shutdown()


def test_fuse_projections_flag_trains_like_separate_matmuls(tmp_path, monkeypatch):
    separate = _train_in_process(tmp_path / "separate", [])
    calls = []
    concatenated = LocalContext._concatenated_linear
    monkeypatch.setattr(LocalContext, "_concatenated_linear",
                        lambda self, x, w: calls.append(len(w)) or concatenated(self, x, w))
    fused = _train_in_process(tmp_path / "fused", ["--fuse-projections"])
    assert calls and set(calls) == {2, 3}  # gate/up and q/k/v
    for a, b in zip(separate, fused):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
