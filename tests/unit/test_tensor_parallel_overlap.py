"""Overlapped tensor + sequence parallelism (parallel/tensor_parallel.py): the collectives one block
issues, counted in a fake world of 2 ranks (no data moves, so values are not compared here), the
fused matmuls and loss against whole-tensor math on 2 gloo processes, the plan's region, and the
--tp-overlap choices. Loss parity of whole runs is in tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.layout import Machine
from models import llama, spec
from models.errors import UserError
from models.presets import get_model_config
from parallel import recompute, tensor_parallel
from parallel.context import ParallelContext
from parallel.layout import ParallelLayout
from parallel.mesh import MeshSpec, build_meshes
from parallel.plan import Plan
from tests.layouts import resolved


CFG = get_model_config("tiny")


BATCH, SEQ = 2, 12  # sequence shards of 6 tokens: tp=2 chunks of 3


def _block(overlap: str | None, recompute_mode: str = "none"):
    """One tiny Llama block on the tp=2 mesh with random weights, its sequence-sharded input, and
    the (recompute-wrapped) forward."""
    mesh_spec = MeshSpec.parse("tp=2", 2)
    plan = Plan.build(mesh_spec, sequence_parallel=True, num_kv_heads=CFG.num_kv_heads,
                      tp_overlap=overlap is not None)
    meshes = build_meshes(mesh_spec, "cpu")
    mesh = meshes.world
    ctx = ParallelContext(ParallelLayout(plan, tp_overlap=overlap), meshes)
    block = llama.layers(CFG)[1]
    params = spec.unflatten({
        path: distribute_tensor(torch.randn(p.shape), mesh[plan.param_mesh_dims], plan.param_placements(p.axes),
                                src_data_rank=None).requires_grad_()
        for path, p in spec.flatten(block.params)})
    x = DTensor.from_local(torch.randn(BATCH, SEQ // 2, CFG.dim), mesh["tp"], [Shard(1)]).requires_grad_()
    aux = llama.make_aux(CFG, torch.arange(SEQ))
    return recompute.wrap(block.forward, recompute_mode), params, x, aux, ctx


@pytest.fixture
def tp2(fake_world):
    with fake_world(2):
        yield


class _OpOrder(TorchDispatchMode):
    """Every op that reaches the dispatcher, in order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_on_gloo_each_chunks_collective_is_waited_on_before_any_other_op(tp2):
    # Several functional collectives in flight at once on gloo's worker threads crashed runs now and
    # then: a pp=2,tp=2 run with SP died on SIGSEGV in the chunked reduce-scatter's
    # backward, which had issued every chunk's collective before waiting on the first.
    block_fn, params, x, aux, ctx = _block("chunked")
    with _OpOrder() as order:
        out = block_fn(params, x, aux, ctx).to_local()
        out.backward(torch.randn_like(out))
    issued = [i for i, name in enumerate(order.names)
              if name.partition("::")[0] == "_c10d_functional" and not name.endswith("wait_tensor")]
    assert len(issued) == 8 * len(tensor_parallel.chunk_bounds(SEQ // 2, 2)), order.names
    unwaited = [order.names[i:i + 2] for i in issued if order.names[i + 1] != "_c10d_functional::wait_tensor"]
    assert not unwaited, unwaited


def test_plan_leaves_block_inputs_sequence_sharded_only_when_overlapping():
    mesh_spec = MeshSpec.parse("tp=2", 2)
    unfused = Plan.build(mesh_spec, sequence_parallel=True)
    fused = Plan.build(mesh_spec, sequence_parallel=True, tp_overlap=True)
    axes = llama.RESIDUAL
    assert unfused.activation_placements(axes, "block_input") == (Replicate(),)
    assert fused.activation_placements(axes, "block_input") == (Shard(1),)
    assert fused.overlaps_tp and not unfused.overlaps_tp
    assert not Plan.build(mesh_spec, tp_overlap=True).overlaps_tp  # no SP: nothing to fuse
    assert "fused with the matmuls" in fused.describe(llama.layers(CFG))


@pytest.mark.parametrize("choice,sp,async_tp,device,expected", [
    ("auto", True, False, "cpu", "chunked"),
    ("auto", False, False, "cpu", None),
    ("auto", True, True, "cuda", None),
    ("auto", True, False, "cuda", None),  # the fused ops measured slower than separate collectives
    ("chunked", True, False, "cuda", "chunked"),
    ("none", True, False, "cpu", None),
])
def test_tp_overlap_choice_resolves(choice, sp, async_tp, device, expected):
    assert tensor_parallel.resolve_method(choice, sequence_parallel=sp, tp=2, device_type=device,
                                          async_tp=async_tp) == expected


def test_start_up_log_names_the_matmuls_left_unfused():
    mesh_spec = MeshSpec.parse("tp=2", 2)
    plan = Plan.build(mesh_spec, sequence_parallel=True, num_kv_heads=CFG.num_kv_heads, tp_overlap=True)
    assert tensor_parallel.unfused_matmuls(plan, fp8=False, fp8_head=False) == []
    reasons = tensor_parallel.unfused_matmuls(plan, fp8=True, fp8_head=True)
    assert len(reasons) == 2 and "FP8 blocks" in reasons[0] and "FP8 output head" in reasons[1]
    whole_kv = Plan.build(MeshSpec.parse("tp=4", 4), sequence_parallel=True, num_kv_heads=2, tp_overlap=True)
    assert [r for r in tensor_parallel.unfused_matmuls(whole_kv, fp8=False, fp8_head=False) if "q/k/v" in r]


def test_tp_overlap_and_async_tp_are_not_both_asked_for():
    with pytest.raises(UserError, match="give one"):
        tensor_parallel.resolve_method("symm_mem", sequence_parallel=True, tp=2, device_type="cuda", async_tp=True)


@pytest.mark.parametrize("flags,message", [
    (["--mesh", "tp=2", "--tp-overlap", "chunked"], "give --sequence-parallel"),
    (["--mesh", "tp=2", "--sequence-parallel", "--seq-len", "63"], "divisible by 2"),
    (["--mesh", "cp=2,tp=4", "--sequence-parallel", "--seq-len", "12"], "divisible by 8"),
] + ([] if torch.cuda.is_available() else [
    (["--mesh", "tp=2", "--sequence-parallel", "--tp-overlap", "symm_mem"], "needs CUDA"),
]))
def test_bad_tp_overlap_is_refused_before_any_work(flags, message):
    with pytest.raises(UserError, match=message):
        resolved(["--model", "tiny", *flags], None, Machine.detect())
