"""`--fp8-experts` (the routed experts' grouped GEMMs in Transformer Engine's FP8) through
tests/fake_te.py: the op against the same casts and matmuls written out per expert, each expert's
rows padded for the FP8 GEMMs, delayed scaling's slots of each global expert, and training runs
against the bf16 experts and across expert parallelism. On TE and a GPU: tests/integration/test_te_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import fake_te


DIM, FFN = 32, 64


# Uneven loads: one expert without rows, none a multiple of the FP8 GEMM's 16.
COUNTS = [5, 0, 21, 7]


def _quantized(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Current scaling's cast and back, written here apart from the fake."""
    amax = t.float().abs().amax() if t.numel() else torch.zeros(())
    scale = torch.where(amax > 0, torch.finfo(dtype).max / amax, torch.ones(()))
    return (t.float() * scale).to(dtype).float() / scale


def _inputs(counts=COUNTS, seed: int = 0):
    torch.manual_seed(seed)
    experts = len(counts)

    def weight(*shape):
        return (torch.randn(experts, *shape) / shape[-1] ** 0.5).to(torch.bfloat16).requires_grad_()

    x = torch.randn(sum(counts), DIM).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(sum(counts), DIM).to(torch.bfloat16)
    return x, torch.tensor(counts), weight(FFN, DIM), weight(FFN, DIM), weight(DIM, FFN), grad


def _reference(x, counts, w_gate, w_up, w_down, grad):
    """Per expert: current scaling's casts, the fp32 matmuls, bf16 outputs; SwiGLU's gradients by
    autograd in bf16."""
    out, grad_x, grads_w = [], [], {"gate": [], "up": [], "down": []}
    for e, (rows, g) in enumerate(zip(x.detach().split(counts.tolist()), grad.split(counts.tolist()))):
        xq, gq = _quantized(rows), _quantized(g, torch.float8_e5m2)
        wg, wu, wd = (_quantized(w[e].detach()) for w in (w_gate, w_up, w_down))
        gate, up = (xq @ wg.t()).bfloat16().requires_grad_(), (xq @ wu.t()).bfloat16().requires_grad_()
        hidden = F.silu(gate) * up
        hq = _quantized(hidden.detach())
        out.append((hq @ wd.t()).bfloat16())
        grad_gate, grad_up = torch.autograd.grad(hidden, (gate, up), (gq @ wd).bfloat16())
        ggq, guq = _quantized(grad_gate, torch.float8_e5m2), _quantized(grad_up, torch.float8_e5m2)
        grad_x.append(((ggq @ wg).bfloat16().float() + guq @ wu).bfloat16())
        grads_w["gate"].append((ggq.t() @ xq).bfloat16())
        grads_w["up"].append((guq.t() @ xq).bfloat16())
        grads_w["down"].append((gq.t() @ hq).bfloat16())
    return torch.cat(out), torch.cat(grad_x), {k: torch.stack(v) for k, v in grads_w.items()}


@pytest.fixture
def te():
    with fake_te.installed() as calls:
        from parallel import te_experts
        from parallel.te_linear import TELinear

        yield TELinear, te_experts, calls


def test_fp8_experts_are_te_casts_then_grouped_gemms_over_padded_rows(te):
    TELinear, te_experts, calls = te
    experts = te_experts.for_layers(TELinear("current", torch.device("cpu")), {"blocks.0": len(COUNTS)})["blocks.0"]
    x, counts, w_gate, w_up, w_down, grad = _inputs()
    out = experts(x, counts, w_gate, w_up, w_down)
    out.backward(grad)
    want_out, want_grad_x, want_grads_w = _reference(x, counts, w_gate, w_up, w_down, grad)
    # The same casts and products; padding rows of zeros only moves fp32 rounding (a bf16 ulp at most).
    tolerance = dict(rtol=8e-3, atol=1e-4)
    torch.testing.assert_close(out, want_out, **tolerance)
    torch.testing.assert_close(x.grad, want_grad_x, **tolerance)
    for name, w in (("gate", w_gate), ("up", w_up), ("down", w_down)):
        torch.testing.assert_close(w.grad, want_grads_w[name], **tolerance)
    assert w_gate.grad[1].abs().max() == 0  # the expert without rows
    gemms = [c for c in calls if c["op"] == "grouped_gemm"]
    assert [g["layout"] for g in gemms] == ["TN"] * 3 + ["NN", "NT", "NN", "NT", "NN", "NT"]
    assert [g["accumulate"] for g in gemms if g["layout"] == "NN"] == [False, False, True]
    # Each expert's rows padded to 16; the last takes the slack of a fixed-size buffer.
    rows = te_experts.padded_rows(sum(COUNTS), len(COUNTS), 16)
    assert all(g["splits"] == [16, 0, 32, rows - 48] for g in gemms)
    # FP8's error: it was used, and it is small.
    bf16 = torch.cat([F.linear(F.silu(F.linear(r, w_gate[e])) * F.linear(r, w_up[e]), w_down[e])
                      for e, r in enumerate(x.detach().split(COUNTS))])
    relative = ((out.float() - bf16.float()).norm() / bf16.float().norm()).item()
    assert 1e-3 < relative < 0.1, relative


def test_delayed_scaling_experts_use_and_record_the_slots_of_their_global_experts(te):
    """A rank holding experts 2 and 3 of 4 (first=2): their slots, matmul m of expert e at row
    m * 4 + e, get the amaxes; the others stay zero for the amax reduction to fill in."""
    TELinear, te_experts, calls = te
    backend = TELinear("delayed", torch.device("cpu"))
    experts = te_experts.for_layers(backend, {"blocks.0": 4})["blocks.0"]
    assert {name: tuple(shape) for name, shape in backend.scaling.layer_shapes().items()
            if name.startswith("blocks.0")} == {"blocks.0.experts.amax_history": (1024, 36),
                                                "blocks.0.experts.scale": (36,)}
    experts.scale.copy_(torch.arange(1, 37, dtype=torch.float32).view(12, 3))
    x, counts, w_gate, w_up, w_down, grad = _inputs([9, 18])
    experts(x, counts, w_gate, w_up, w_down, first=2).backward(grad)
    amax = experts.amax.view(3, 4, 3)  # [gate/up/down, expert, input/weight/gradient]
    assert amax[:, :2].abs().max() == 0
    for e, rows in zip((2, 3), x.detach().split([9, 18])):
        assert amax[0, e, 0] == rows.abs().max().float()
        assert amax[1, e, 0] == 0  # up reads gate's cast of the input
        for m, w in enumerate((w_gate, w_up, w_down)):
            assert amax[m, e, 1] == w[e - 2].detach().abs().max().float()
        assert (amax[:, e, 2] > 0).all() and amax[2, e, 0] > 0
    # Expert 3's weights were cast with its own weight slots' scales.
    weight_scales = {c["scale"] for c in calls if c["op"] == "quantize" and c["shape"] in ([FFN, DIM], [DIM, FFN])}
    assert {experts.scale[m * 4 + e, 1].item() for m in range(3) for e in (2, 3)} == weight_scales
    before = experts.amax.clone()
    with torch.no_grad():
        experts(x * 4, counts, w_gate, w_up, w_down, first=2)
    assert torch.equal(experts.amax, before)
    # The rank's quantizers are looked up once per block of slots (training's, and evaluation's).
    made = te_experts.kernels("delayed").dense.made
    blocks = sorted(key for key in made if key[0] == "experts")
    assert len(blocks) == 2 and all(key[3:] == (2, 2) for key in blocks)
    experts(x, counts, w_gate, w_up, w_down, first=2).backward(grad)
    assert sorted(key for key in made if key[0] == "experts") == blocks


MOE = ["--model", "tiny-moe", "--steps", "2", "--seed", "0", "--seq-len", "64", "--global-batch", "4",
       "--micro-batch", "2", "--lr", "1e-3", "--precision", "bf16", "--fp8-backend", "te", "--fp8", "delayed"]


def _train(run_dir, extra: list[str]) -> list[float]:
    from dtrain import distributed
    from dtrain.layout import Machine
    from dtrain.trainer import Trainer
    from tests.layouts import resolved

    layout = resolved([*MOE, "--run-dir", str(run_dir), *extra], machine=Machine.detect())
    runtime = distributed.init_process_group()
    try:
        return [h["train/loss"] for h in Trainer(layout, runtime).fit()]
    finally:
        distributed.shutdown()


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny", "--fp8", "delayed", "--fp8-backend", "te", "--fp8-experts"],
     "this model has no routed experts"),
    (["--model", "tiny-moe", "--fp8-backend", "te", "--fp8-experts"], "give --fp8 RECIPE with it"),
    (["--model", "tiny-gpt-oss", "--fp8", "delayed", "--fp8-backend", "te", "--fp8-experts"],
     "use --fp8-backend torchao for FP8 experts"),
])
def test_te_fp8_experts_without_a_recipe_routed_experts_or_plain_swiglu_are_refused_in_one_line(args, message, capsys):
    from dtrain.run import main

    with fake_te.installed():
        assert main([*args, "--precision", "bf16", "--print-plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


