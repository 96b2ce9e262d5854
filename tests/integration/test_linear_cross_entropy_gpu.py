"""The chunked output projection and loss (--loss-chunk-tokens) on a GPU, at llama-1b's head shape
(width 2,048, vocabulary 128,256, its benchmark's 16,384 tokens a micro-batch, bf16, compiled as
the trainer compiles the head): as accurate as the unfused head against an fp32 reference, the
drop of peak memory the memory model predicts, and the time of each. Marked gpu (skipped without
CUDA). On the GPU machine:

    python -m pytest -m gpu tests/integration/test_linear_cross_entropy_gpu.py -v -s

prints, per chunk size, the head's peak memory above its inputs and its forward + backward time
beside the unfused head's; the whole model's: `python -m tools.bench_suite --gpus 2 --group loss-chunks`."""

from __future__ import annotations

import attrs
import pytest
import torch

from dtrain.layout import Machine
from tests.layouts import resolved
from dtrain.planner import activations
from dtrain.planner.workload import workload
from models import llama, spec
from models.context import LocalContext
from models.presets import get_model_config


pytestmark = pytest.mark.gpu

SHAPE = ["--model", "llama-1b", "--seq-len", "4096", "--micro-batch", "4", "--compile"]
TOKENS = 4 * 4096


def predicted_gb(chunk: int) -> float:
    """The memory model's head: what it keeps for the backward and what comes on top."""
    layout = resolved([*SHAPE, "--loss-chunk-tokens", str(chunk)], 1, Machine.gpu_profile("h200"))
    saved, extra = activations.head_bytes(workload(layout))
    return (saved + extra) / 1e9


def _head(device: torch.device, dtype: torch.dtype, cfg, tokens: int, seed: int = 0):
    head = llama.layers(cfg)[-1]
    params = {path: spec.init_value(s, seed, path, device=device).to(dtype).requires_grad_()
              for path, s in spec.flatten(head.params)}
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(1, tokens, cfg.dim, device=device, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, cfg.vocab_size, (1, tokens), device=device, generator=generator)
    labels[0, :100] = -100
    aux = attrs.evolve(llama.make_aux(cfg, torch.arange(tokens, device=device)), labels=labels)
    return head, params, x, aux


def run_head(forward, params, x, aux, chunk: int, compile_chunks: bool):
    ctx = LocalContext()
    ctx.loss_chunk_tokens, ctx.compile_loss_chunks = chunk, compile_chunks
    loss = forward(spec.unflatten(params), x, aux, ctx)
    grads = torch.autograd.grad(loss / 8192, [x, params["output"]])
    return [loss.detach(), *grads]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("chunk", [1024, 2048])
def test_chunked_head_on_a_gpu_is_as_accurate_and_smaller(chunk):
    device = torch.device("cuda")
    cfg = get_model_config("llama-1b")
    head, params, x, aux = _head(device, torch.bfloat16, cfg, TOKENS)
    torch._dynamo.reset()
    compiled = torch.compile(head.forward)
    reference = run_head(head.forward, {k: v.float() for k, v in params.items()}, x.float(), aux, 0, False)
    results, peaks, times = {}, {}, {}
    for name, size in (("unfused", 0), ("chunked", chunk)):
        run_head(compiled, params, x, aux, size, True)  # compiles
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        results[name] = run_head(compiled, params, x, aux, size, True)
        end.record()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 1e9
        times[name] = start.elapsed_time(end)
    predicted = {"unfused": predicted_gb(0), "chunked": predicted_gb(chunk)}
    print(f"\nchunk {chunk}: head peak above its inputs {peaks['chunked']:.2f} GB against {peaks['unfused']:.2f} "
          f"unfused (memory model {predicted['chunked']:.2f} and {predicted['unfused']:.2f}); forward + backward "
          f"{times['chunked']:.1f} ms against {times['unfused']:.1f}")
    for i, name in enumerate(("loss", "d input", "d weight")):
        error, baseline = _relative(results["chunked"][i], reference[i]), _relative(results["unfused"][i], reference[i])
        print(f"  {name}: error against fp32 {error:.2e} (unfused {baseline:.2e})")
        assert error <= 1.3 * baseline + 1e-6, (name, error, baseline)
    # At least half the drop the memory model predicts (1.6 to 2.1 GB).
    assert peaks["unfused"] - peaks["chunked"] >= 0.5 * (predicted["unfused"] - predicted["chunked"]), (peaks, predicted)
