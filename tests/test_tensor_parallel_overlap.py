"""Overlapped tensor + sequence parallelism (parallel/tensor_parallel.py): the collectives one block
issues, counted in a fake world of 2 ranks (no data moves, so values are not compared here), the
fused matmuls and loss against whole-tensor math on 2 gloo processes, the plan's region, and the
--tp-overlap choices. Loss parity of whole runs is in tests/test_tensor_parallel.py."""

from __future__ import annotations

from collections import Counter

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
from tests.launch import run_cli, train_scalars
from tests.layouts import resolved

CFG = get_model_config("tiny")
BATCH, SEQ = 2, 12  # sequence shards of 6 tokens: tp=2 chunks of 3
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


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


def _profiled_collectives(run) -> Counter:
    """The collectives `run()` issues, as the profiler sees them (it sees the ones DTensor issues
    inside its own dispatch too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = (e.name.partition("::") for e in prof.events())
    return Counter(op for namespace, _, op in names if namespace in ("_c10d_functional", "symm_mem")
                   and op in COLLECTIVES)


class _DispatchedCollectives(TorchDispatchMode):
    """The collectives that reach the dispatcher below any mode entered after this one: what
    selective recompute answers from its cache does not (unlike what the profiler records)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, op = func.name().partition("::")
        if namespace in ("_c10d_functional", "symm_mem") and op.split(".")[0] in COLLECTIVES:
            self.counts[op.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _dispatched_collectives(run) -> Counter:
    with _DispatchedCollectives() as mode:
        run()
    return mode.counts


def _collectives_per_phase(overlap: str | None, recompute_mode: str = "none",
                           count=_profiled_collectives) -> dict[str, Counter]:
    block_fn, params, x, aux, ctx = _block(overlap, recompute_mode)
    outputs = []
    forward = count(lambda: outputs.append(block_fn(params, x, aux, ctx).to_local()))
    backward = count(lambda: outputs[0].backward(torch.randn_like(outputs[0])))
    return {"forward": forward, "backward": backward}


@pytest.fixture
def tp2(fake_world):
    with fake_world(2):
        yield


def _calls(monkeypatch):
    """Records the width of each fused gather (number of weights) and scatter (number of sums)."""
    calls = []
    for name in ("all_gather_matmul", "matmul_reduce_scatter"):
        original = getattr(tensor_parallel, name)

        def recording(first, second, *rest, _name=name, _original=original):
            calls.append((_name, len(second) if _name == "all_gather_matmul" else len(first)))
            return _original(first, second, *rest)

        monkeypatch.setattr(tensor_parallel, name, recording)
    return calls


def test_overlapped_block_issues_one_gather_and_one_scatter_per_matmul_group(tp2, monkeypatch):
    calls = _calls(monkeypatch)
    counts = _collectives_per_phase("chunked")
    chunks = len(tensor_parallel.chunk_bounds(SEQ // 2, 2))
    assert chunks == 2
    # Forward: q/k/v share one gather, gate/up one; wo and w_down scatter their own outputs.
    # Backward: the mirror image. Each in tp chunks, and no collective outside them.
    assert calls == [("all_gather_matmul", 3), ("matmul_reduce_scatter", 1),
                     ("all_gather_matmul", 2), ("matmul_reduce_scatter", 1),
                     ("all_gather_matmul", 1), ("matmul_reduce_scatter", 2),
                     ("all_gather_matmul", 1), ("matmul_reduce_scatter", 3)], calls
    for phase in ("forward", "backward"):
        assert counts[phase] == Counter(all_gather_into_tensor=2 * chunks, reduce_scatter_tensor=2 * chunks), \
            (phase, counts[phase])


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


def test_unfused_block_issues_dtensor_collectives(tp2, monkeypatch):
    """The same count without overlap: what the test above would see if the fused path were
    silently skipped (one whole gather per matmul group, one reduce-scatter per residual add)."""
    calls = _calls(monkeypatch)
    counts = _collectives_per_phase(None)
    assert calls == []
    assert counts["forward"] == Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2), counts


def test_selective_recompute_keeps_the_fused_collectives(tp2):
    totals = {mode: sum(_collectives_per_phase("chunked", mode, _dispatched_collectives)["backward"].values())
              for mode in recompute.RECOMPUTE_MODES}
    assert totals["selective"] == totals["none"] > 0, totals
    assert totals["full"] > totals["none"], totals  # full recompute gathers and scatters again


@pytest.mark.slow
def test_fused_matmuls_and_vocab_parallel_loss_match_whole_tensor_math():
    result = run_cli(["chunked"], nproc=2, module="tests.workers.tp_overlap")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend", [[], ["inductor"]], ids=["eager", "compiled"])
def test_symmetric_memory_matmuls_run_and_match_whole_tensor_math_on_two_gpus(backend):
    """torch's fused ops, called (the worker profiles them) and right, forward and backward."""
    result = run_cli(["symm_mem", *backend], nproc=2, module="tests.workers.tp_overlap")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_compiled_symmetric_memory_training_matches_unfused_on_two_gpus(tmp_path):
    """Whole compiled runs, fp32 (no TF32: both runs use the same GEMMs), 10 steps: --tp-overlap
    auto resolves to symm_mem on GPUs; its losses against DTensor's separate collectives."""
    sp = ["--mesh", "tp=2", "--sequence-parallel", "--compile"]
    fused = train_scalars(tmp_path / "fused", sp, nproc=2)
    unfused = train_scalars(tmp_path / "unfused", [*sp, "--tp-overlap", "none"], nproc=2)
    for step, (a, e) in enumerate(zip(fused["train/loss"], unfused["train/loss"], strict=True), 1):
        assert abs(a - e) <= 1e-4 * abs(e), f"loss at step {step}: symm_mem {a} vs unfused {e}"
