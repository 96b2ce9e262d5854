"""`--fp8-backend te` on GPUs with Transformer Engine (marked gpu; skipped without CUDA or TE).
On a GPU machine with TE installed (`pip install -e '.[te]'`; a hand-built install sources its
`.te/env.sh` first, which points TE at torch's cuDNN):

    . .te/env.sh && python -m pytest -m gpu tests/integration/test_te_gpu.py -v

dtrain's TE matmul against te.Linear itself (the same quantization, so the same numbers), against
bf16, and training: one GPU against bf16, two GPUs (dp=2, tp=2 with sequence parallelism, pp=2,
MoE with ep=2) against one, compiled with selective recompute against eager, and the FP8 state's
checkpoint round trip. The wiring without TE: tests/integration/test_te_linear.py."""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_cli, scalars


pytestmark = pytest.mark.gpu
te = pytest.importorskip("transformer_engine.pytorch", reason="needs Transformer Engine (pip install -e '.[te]')")

RECIPES = {"delayed": ("DelayedScaling", te.is_fp8_available), "current": ("Float8CurrentScaling", te.is_fp8_available),
           "mxfp8": ("MXFP8BlockScaling", te.is_mxfp8_available),
           "blockwise": ("Float8BlockScaling", te.is_fp8_block_scaling_available)}
# A llama small enough for seconds per run, with dims every recipe takes (multiples of 128).
SMALL = ["--model", "tiny", "--model-overrides", "dim=256,ffn_dim=768,num_heads=4,num_kv_heads=2,vocab_size=2048",
         "--seed", "0", "--precision", "bf16", "--seq-len", "256", "--micro-batch", "4", "--lr", "1e-3"]
TE_DELAYED = ["--fp8", "delayed", "--fp8-backend", "te"]


def _supported(recipe: str) -> None:
    ok, reason = RECIPES[recipe][1](return_reason=True)
    if not ok:
        pytest.skip(f"{recipe}: {reason}")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_dtrain_te_matmul_is_te_linear_with_our_weight(recipe):
    """Forward and both gradients as te.Linear computes them under te.autocast (its first step:
    delayed scaling's scales are 1 in both), and within FP8's error of bf16."""
    _supported(recipe)
    from transformer_engine.common import recipe as te_recipe

    from parallel.te_linear import TELinear

    torch.manual_seed(0)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    grad = torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16)

    module = te.Linear(1024, 1536, bias=False, params_dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    x_te = x.clone().requires_grad_()
    with te.autocast(enabled=True, recipe=getattr(te_recipe, RECIPES[recipe][0])()):
        out_te = module(x_te)
    out_te.backward(grad)

    layer = TELinear(recipe, torch.device("cuda")).for_layers({"layer": 1})["layer"]
    x_ours, w_ours = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = layer.wrap_forward(layer)(x_ours, w_ours)
    out.backward(grad)

    for name, ours, theirs in (("output", out, out_te), ("input grad", x_ours.grad, x_te.grad),
                               ("weight grad", w_ours.grad, module.weight.grad)):
        assert _relative(ours, theirs) <= 1e-3, (name, _relative(ours, theirs))
    reference = x.float() @ w.float().t()
    assert 1e-4 < _relative(out, reference) < 0.08, _relative(out, reference)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_experts_are_te_grouped_linear_with_our_weights(recipe):
    """The experts' SwiGLU (gate, up, down: one te.GroupedLinear each, under te.autocast's first
    step) against dtrain's op on the same [experts, out, in] weights, forward and gradients."""
    _supported(recipe)
    from transformer_engine.common import recipe as te_recipe

    from parallel.te_experts import for_layers
    from parallel.te_linear import TELinear

    torch.manual_seed(0)
    splits, dim, ffn = [256, 0, 512, 256], 512, 1024
    x = torch.randn(sum(splits), dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(sum(splits), dim, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(len(splits), out, inp, device="cuda", dtype=torch.bfloat16) / inp ** 0.5
               for out, inp in ((ffn, dim), (ffn, dim), (dim, ffn))]

    modules = [te.GroupedLinear(len(splits), w.shape[2], w.shape[1], bias=False, params_dtype=torch.bfloat16)
               for w in weights]
    with torch.no_grad():
        for module, w in zip(modules, weights):
            for e in range(len(splits)):
                getattr(module, f"weight{e}").copy_(w[e])
    x_te = x.clone().requires_grad_()
    with te.autocast(enabled=True, recipe=getattr(te_recipe, RECIPES[recipe][0])()):
        gate, up = modules[0](x_te, splits), modules[1](x_te, splits)
        out_te = modules[2](torch.nn.functional.silu(gate) * up, splits)
    out_te.backward(grad)

    experts = for_layers(TELinear(recipe, torch.device("cuda")), {"layer": len(splits)})["layer"]
    x_ours = x.clone().requires_grad_()
    ours = [w.clone().requires_grad_() for w in weights]
    out = experts(x_ours, torch.tensor(splits, device="cuda"), *ours)
    out.backward(grad)

    assert _relative(out, out_te) <= 1e-3, _relative(out, out_te)
    assert _relative(x_ours.grad, x_te.grad) <= 1e-3, _relative(x_ours.grad, x_te.grad)
    for name, w, module in zip(("gate", "up", "down"), ours, modules):
        theirs = torch.stack([getattr(module, f"weight{e}").grad for e in range(len(splits))])
        assert _relative(w.grad, theirs) <= 1e-3, (name, _relative(w.grad, theirs))
    assert w.grad[1].abs().max() == 0  # the expert without rows
    reference = torch.cat([torch.nn.functional.linear(torch.nn.functional.silu(r.float() @ weights[0][e].float().t())
                                                      * (r.float() @ weights[1][e].float().t()), weights[2][e].float())
                           for e, r in enumerate(x.split(splits))])
    assert 1e-4 < _relative(out, reference) < 0.08, _relative(out, reference)


def _train(run_dir, extra: list[str], nproc: int = 1, steps: int = 20, module: str = "dtrain.run") -> list[float]:
    result = run_cli([*SMALL, "--steps", str(steps), "--run-dir", str(run_dir), *extra], nproc=nproc, module=module)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    losses = scalars(run_dir)["train/loss"]
    assert len(losses) == steps
    return losses


def _assert_tracks(losses: list[float], reference: list[float], rtol: float, what: str) -> None:
    for step, (a, e) in enumerate(zip(losses, reference), 1):
        assert abs(a - e) <= rtol * e, f"{what} at step {step}: {a} vs {e}"


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise"])
def test_one_gpu_trains_like_bf16(tmp_path, recipe):
    _supported(recipe)
    bf16 = _train(tmp_path / "bf16", ["--global-batch", "4"])
    fp8 = _train(tmp_path / recipe, ["--global-batch", "4", "--fp8", recipe, "--fp8-backend", "te"])
    assert fp8 != bf16, "the TE run computed exactly the bf16 losses: FP8 was not used"
    _assert_tracks(fp8, bf16, 0.03, f"--fp8 {recipe}")


def test_compiled_with_selective_recompute_matches_eager(tmp_path):
    """Inductor compiles each block around the TE op (no recompile beyond the dynamic-shape one)."""
    eager = _train(tmp_path / "eager", ["--global-batch", "4", *TE_DELAYED], steps=10)
    compiled = _train(tmp_path / "compiled", ["--global-batch", "4", *TE_DELAYED, "--compile", "--recompute",
                                              "selective"], steps=10, module="tests.workers.strict_recompiles")
    _assert_tracks(compiled, eager, 0.01, "compiled")


TWO_GPU_MESHES = {"dp=2": ["--mesh", "dp=2"], "tp=2 sp": ["--mesh", "tp=2", "--sequence-parallel"],
                  "pp=2": ["--mesh", "pp=2", "--micro-batch", "2"]}


@pytest.mark.parametrize("mesh", list(TWO_GPU_MESHES))
def test_two_gpus_train_like_one(tmp_path, mesh):
    """The same global batch on one GPU and on two: delayed scaling's amaxes reduced over the
    ranks give one device's scales, so only bf16 rounding differs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    one = _train(tmp_path / "one", ["--global-batch", "8", *TE_DELAYED])
    two = _train(tmp_path / "two", ["--global-batch", "8", *TE_DELAYED, *TWO_GPU_MESHES[mesh]], nproc=2)
    _assert_tracks(two, one, 0.01, mesh)


def test_moe_with_expert_parallelism_trains_like_bf16(tmp_path):
    """Attention and shared experts in FP8 through TE; the routed experts' grouped GEMMs in bf16."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    moe = ["--model", "tiny-moe", "--seed", "0", "--precision", "bf16", "--seq-len", "256", "--micro-batch", "4",
           "--global-batch", "8", "--lr", "1e-3", "--mesh", "dp=2,ep=2", "--steps", "20"]
    bf16 = run_cli([*moe, "--run-dir", str(tmp_path / "bf16")], nproc=2)
    fp8 = run_cli([*moe, "--run-dir", str(tmp_path / "te"), *TE_DELAYED], nproc=2)
    for result in (bf16, fp8):
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    _assert_tracks(scalars(tmp_path / "te")["train/loss"], scalars(tmp_path / "bf16")["train/loss"], 0.03, "ep=2")


MOE = ["--model", "tiny-moe", "--seed", "0", "--precision", "bf16", "--seq-len", "256", "--micro-batch", "4",
       "--global-batch", "8", "--lr", "1e-3", "--steps", "20"]


@pytest.mark.parametrize("mesh", ["single", "dp=2,ep=2"])
def test_fp8_experts_train_like_bf16_experts(tmp_path, mesh):
    """--fp8-experts (router-given, uneven rows per expert) against the same run with the experts in bf16."""
    nproc = 1 if mesh == "single" else 2
    if torch.cuda.device_count() < nproc:
        pytest.skip("needs 2 CUDA GPUs")
    args = [*MOE, *TE_DELAYED, *([] if mesh == "single" else ["--mesh", mesh]), "--compile"]
    for name, extra in (("bf16-experts", []), ("fp8-experts", ["--fp8-experts"])):
        result = run_cli([*args, "--run-dir", str(tmp_path / name), *extra], nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    fp8, bf16 = (scalars(tmp_path / name)["train/loss"] for name in ("fp8-experts", "bf16-experts"))
    assert fp8 != bf16, "the experts' FP8 run computed exactly the bf16 losses"
    _assert_tracks(fp8, bf16, 0.03, f"--fp8-experts {mesh}")


def test_fp8_state_round_trips_through_a_checkpoint(tmp_path):
    """The amax histories and scales a run saved are the ones a resumed run holds, bit for bit,
    and the resumed run continues the losses."""
    from torch.distributed.checkpoint import FileSystemReader

    from dtrain import distributed
    from dtrain.checkpoint import train_state
    from dtrain.layout import Machine
    from dtrain.trainer import Trainer
    from tests.layouts import resolved

    reference = _train(tmp_path / "a", ["--global-batch", "4", *TE_DELAYED, "--checkpoint-every", "5"], steps=10)
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000005"
    names = [k[len("fp8."):] for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
             if k.startswith("fp8.")]
    saved = train_state.load_fp8_state(checkpoint, names)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("amax_history"))
    layout = resolved([*SMALL, "--global-batch", "4", *TE_DELAYED, "--steps", "10", "--run-dir", str(tmp_path / "b"),
                       "--resume", str(checkpoint)], machine=Machine.detect())
    runtime = distributed.init_process_group()
    try:
        trainer = Trainer(layout, runtime)
        restored = trainer.fp8_scaling.state_dict()
        assert set(restored) == set(saved)
        for name, value in saved.items():
            assert torch.equal(restored[name].cpu(), value), name
        resumed = [h["train/loss"] for h in trainer.fit()]
    finally:
        distributed.shutdown()
    _assert_tracks(resumed, reference[5:], 1e-3, "resumed")
