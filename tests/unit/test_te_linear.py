"""`--fp8-backend te` without Transformer Engine: the one-line errors, and the wiring through
tests/fake_te.py (which casts to torch's float8 dtypes as TE does): local shards and output
placements under tensor parallelism, the usages and scales TE receives, delayed scaling's slots,
selective recompute, checkpoints, compile, and meshes against one process. The same paths on
TE and GPUs: tests/integration/test_te_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dtrain.run import main
from tests import fake_te
from tests.launch import TINY_ARGS


TE = ["--precision", "bf16", "--fp8-backend", "te"]


# Two micro-batches of two sequences a step: enough for scales shared within a step, cheap on CI.
SMALL_BATCH = ["--global-batch", "4", "--micro-batch", "2"]


def _quantized(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Current scaling's cast and back, computed here independently of the fake."""
    scale = torch.finfo(dtype).max / t.float().abs().amax()
    return (t.float() * scale).to(dtype).float() / scale


def test_missing_transformer_engine_is_one_line_that_says_how_to_install_it(capsys):
    assert main(["--model", "tiny", "--fp8", "delayed", *TE, "--print-plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--fp8-backend te needs Transformer Engine" in err and "pip install -e '.[te]'" in err, err


@pytest.mark.parametrize("args,message", [
    (["--fp8", "tensorwise", *TE], "tensorwise is a recipe of --fp8-backend torchao; per-tensor dynamic scaling "
                                    "is --fp8 current there"),
    (["--fp8", "delayed", "--precision", "bf16"], "delayed is a recipe of --fp8-backend te"),
    (["--fp8", "mxfp8", *TE], "--fp8 mxfp8 does not run here: Device compute capability 10.0 or higher"),
    (["--fp8", "delayed", *TE, "--fp8-amax-history", "0"], "--fp8-amax-history 0 must be >= 1"),
    (["--fp8", "current", *TE, "--seq-len", "24", "--micro-batch", "1"], "(micro-batch x sequence per rank = 24)"),
    (["--fp8", "blockwise", *TE], "--fp8 blockwise needs every matmul dim to be a multiple of 128"),
])
def test_bad_te_settings_are_refused_in_one_line(args, message, capsys):
    with fake_te.installed():
        assert main(["--model", "tiny", *args, "--print-plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.fixture
def te():
    with fake_te.installed() as calls:
        from parallel.te_linear import TELinear

        yield TELinear, calls


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(2, 8, 32).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 32) * 0.05).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(2, 8, 48).to(torch.bfloat16)
    return x, w, grad


def test_current_scaling_is_te_quantization_then_the_three_gemms(te):
    TELinear, calls = te
    layer = TELinear("current", torch.device("cpu")).for_layers({"blocks.0": 1})["blocks.0"]
    x, w, grad = _inputs()
    out = layer.wrap_forward(layer)(x, w)
    out.backward(grad)
    xq, wq, gq = _quantized(x), _quantized(w), _quantized(grad, torch.float8_e5m2)
    torch.testing.assert_close(out, (xq @ wq.t()).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, (gq @ wq).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, (gq.flatten(0, 1).t() @ xq.flatten(0, 1)).to(torch.bfloat16), rtol=0, atol=0)
    relative = ((out.float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()).item()
    assert 1e-3 < relative < 0.1, relative  # FP8's error: it was used, and it is small
    gemms = [c for c in calls if c["op"] == "gemm"]
    assert [(g["layout"], g["split_accumulator"]) for g in gemms] == [("TN", False), ("NN", True), ("NT", True)]
    # Forward: row-wise input and weight only; backward: both for the gradient, and column-wise weight
    # and input, which a per-tensor cast makes only beside the row-wise data.
    usages = [(c["shape"], c["rowwise"], c["columnwise"]) for c in calls if c["op"] == "quantize"]
    assert usages == [([48, 32], True, False), ([16, 32], True, False), ([16, 48], True, True),
                      ([48, 32], True, True), ([16, 32], True, True)]


def test_delayed_scaling_casts_with_the_slots_scales_and_records_amaxes_only_when_training(te):
    TELinear, calls = te
    backend = TELinear("delayed", torch.device("cpu"))
    layer = backend.for_layers({"blocks.0": 2})["blocks.0"]
    forward = layer.wrap_forward(lambda x, w: layer(layer(x, w)[..., :32], w))
    x, w, _ = _inputs()
    forward(x, w).float().sum().backward()
    first, second = layer.amaxes
    expected = torch.stack([x.detach().abs().amax().float(), w.detach().abs().amax().float()])
    torch.testing.assert_close(first[:2], expected, rtol=0, atol=0)
    assert first[2] > 0 and second.min() > 0  # the output gradients' amaxes, after backward
    backend.scaling.update()
    assert layer.scales[0][0].item() == pytest.approx(448 / expected[0].item())
    calls.clear()
    before = backend.scaling.parts[0].amax_history.clone()
    with torch.no_grad():
        forward(x * 4, w)  # an evaluation: amaxes go elsewhere, the scales are the training ones
    assert torch.equal(backend.scaling.parts[0].amax_history, before)
    assert calls[1]["scale"] == pytest.approx(layer.scales[0][0].item())
    assert layer.next_matmul == 0


def test_a_forward_calls_each_matmul_slot_once_in_order(te):
    TELinear, _ = te
    layer = TELinear("delayed", torch.device("cpu")).for_layers({"blocks.0": 1})["blocks.0"]
    x, w, _ = _inputs()
    with pytest.raises(RuntimeError, match="a forward called 2 FP8 matmuls, more than the 1"):
        layer.wrap_forward(lambda: layer(layer(x, w)[..., :32], w))()
    layer.wrap_forward(lambda: layer(x, w))()  # the count starts again at each forward


def test_a_new_run_releases_the_quantizers_and_slots_of_the_last_one(te):
    import gc
    import weakref

    TELinear, _ = te
    x, w, _ = _inputs()

    def run_once():
        backend = TELinear("delayed", torch.device("cpu"))
        layer = backend.for_layers({"blocks.0": 1})["blocks.0"]
        layer.wrap_forward(layer)(x, w).float().sum().backward()
        return weakref.ref(backend.scaling.parts[0].scale), layer.amaxes[0].detach().clone()

    first_slots, first_amax = run_once()
    gc.collect()
    assert first_slots() is not None  # cached quantizers hold views of the run's slots
    second_slots, second_amax = run_once()
    gc.collect()
    assert first_slots() is None and second_slots() is not None
    assert torch.equal(first_amax, second_amax)  # the new run's quantizers write its own slots


class _Recorder:
    """A local-shard FP8 backend that records what it is given and multiplies in full precision."""

    on_local_shards = True

    def __init__(self):
        self.seen = []

    def __call__(self, x, weight):
        assert not isinstance(x, DTensor) and not isinstance(weight, DTensor)
        self.seen.append((tuple(x.shape), tuple(weight.shape)))
        return x @ weight.t()


@pytest.mark.parametrize("x_layout,w_layout,seen,out_layout", [
    # column: the whole input, this rank's output features, output split over them
    ("replicate", Shard(0), ((2, 8, 32), (24, 32)), (Shard(2),)),
    # sequence parallel: the sequence shards are gathered first
    ("sequence", Shard(0), ((2, 8, 32), (24, 32)), (Shard(2),)),
    # row: input features split, partial sums out (the next constrain reduces them)
    ("features", Shard(1), ((2, 8, 16), (48, 16)), (Partial(),)),
    # a weight whole on every rank (e.g. the KV projections when tp > KV heads)
    ("replicate", Replicate(), ((2, 8, 32), (48, 32)), (Replicate(),)),
])
def test_te_matmuls_get_local_shards_and_give_the_plans_layout(fake_world, x_layout, w_layout, seen, out_layout):
    from parallel.context import ParallelContext
    from parallel.layout import ParallelLayout
    from parallel.mesh import MeshSpec, build_meshes
    from parallel.plan import Plan

    with fake_world(2):
        spec = MeshSpec.parse("tp=2", 2)
        meshes = build_meshes(spec, "cpu")
        mesh = meshes.world
        recorder = _Recorder()
        ctx = ParallelContext(ParallelLayout(Plan.build(spec, sequence_parallel=True)), meshes).with_fp8(recorder)
        placements = {"replicate": Replicate(), "sequence": Shard(1), "features": Shard(2)}[x_layout]
        x = distribute_tensor(torch.randn(2, 8, 32), mesh["tp"], [placements], src_data_rank=None)
        w = distribute_tensor(torch.randn(48, 32), mesh["tp"], [w_layout], src_data_rank=None)
        x = x.detach().requires_grad_()
        out = ctx.linear(x, w)
        assert recorder.seen == [seen]
        assert tuple(out.placements) == out_layout and tuple(out.shape) == (2, 8, 48)
        out.to_local().sum().backward()
        # The input's gradient: partial sums where each rank used its own output features.
        expected = Partial() if w_layout == Shard(0) else placements if x_layout == "features" else Replicate()
        if x_layout == "sequence":
            expected = Shard(1)  # the gather's backward reduce-scatters the partial sums
        assert tuple(x.grad.placements) == (expected,)


def _train(run_dir: Path, extra: list[str], steps: int = 3, recipe: str = "delayed") -> list[dict[str, float]]:
    """The tiny model trained in this process with the fake TE (already installed)."""
    from dtrain import distributed
    from dtrain.trainer import Trainer
    from tests.layouts import resolved

    layout = resolved([*TINY_ARGS, "--steps", str(steps), "--run-dir", str(run_dir), *TE, *SMALL_BATCH, "--fp8",
                       recipe, *extra])
    runtime = distributed.init_process_group()
    try:
        return Trainer(layout, runtime).fit()
    finally:
        distributed.shutdown()


def _losses(history: list[dict[str, float]]) -> list[float]:
    return [h["train/loss"] for h in history]


def test_selective_recompute_keeps_te_matmul_outputs_and_recomputes_with_the_same_slots(tmp_path):
    """Full recompute runs every forward matmul twice, with the slots of the first run (the
    same losses); selective recompute keeps the matmuls' outputs and runs each once."""
    runs, forward_gemms = {}, {}
    with fake_te.installed() as calls:
        for mode in ("none", "selective", "full"):
            calls.clear()
            runs[mode] = _losses(_train(tmp_path / mode, ["--recompute", mode], steps=2))
            forward_gemms[mode] = sum(1 for c in calls if c["op"] == "gemm" and c["layout"] == "TN")
    # 4 blocks x 7 projections x 2 micro-batches x 2 steps (the head is bf16).
    assert forward_gemms["none"] == 4 * 7 * 2 * 2
    assert forward_gemms["selective"] == forward_gemms["none"]
    assert forward_gemms["full"] == 2 * forward_gemms["none"]
    for mode in ("selective", "full"):
        for step, (a, e) in enumerate(zip(runs[mode], runs["none"]), 1):
            assert abs(a - e) <= 1e-6 * e, f"--recompute {mode} at step {step}: {a} vs {e}"


def test_fused_projections_run_one_te_matmul_for_qkv_and_one_for_gate_and_up(tmp_path):
    """--fuse-projections: 4 forward GEMMs per block (q/k/v, output, gate/up, down) where there were
    7, each with its matmul's slots (the concatenated weight shares one scale), training as
    separate matmuls do within FP8's rounding."""
    with fake_te.installed() as calls:
        separate = _losses(_train(tmp_path / "separate", [], steps=2))
        calls.clear()
        fused = _losses(_train(tmp_path / "fused", ["--fuse-projections"], steps=2))
        gemms = [c for c in calls if c["op"] == "gemm" and c["layout"] == "TN"]
    assert len(gemms) == 4 * 4 * 2 * 2  # 4 blocks x 4 matmuls x 2 micro-batches x 2 steps
    for a, b in zip(fused, separate):
        assert abs(a - b) <= 0.02 * b, (fused, separate)


def _fp8_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader

    from dtrain.checkpoint import train_state

    names = [key[len("fp8."):] for key in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
             if key.startswith("fp8.")]
    return train_state.load_fp8_state(checkpoint, names)
