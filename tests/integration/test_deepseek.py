"""The DeepSeek family's pieces, one process: the presets' sizes against the published ones, MLA
against a per-head reference, YaRN against transformers, group-limited routing and the ranks it
bounds under expert parallelism, multi-token prediction's targets and loss weight, the FLOPs of
MLA and MTP, and where MTP goes in a pipeline."""

from __future__ import annotations

import attrs
import pytest
import torch

from models import deepseek
from models.presets import get_model_config
from parallel import pipeline


def test_the_last_stage_runs_mtp_and_holds_a_copy_of_the_embedding():
    cfg = get_model_config("tiny-mla")
    layers = deepseek.layers(cfg)
    first, last = (pipeline.stage_layers(layers, [2, 2], stage) for stage in (0, 1))
    assert [(layer.name, layer.run) for layer in first] == [("embed", True), ("blocks.0", True), ("blocks.1", True)]
    assert [(layer.name, layer.run) for layer in last] == [("blocks.2", True), ("blocks.3", True), ("mtp", True),
                                                          ("head", True), ("embed", False)]
    # The last stage's cost counts the MTP block and its use of the output head.
    _, head_only = pipeline.layer_costs(deepseek.layers(attrs.evolve(cfg, mtp_depth=0)))
    _, with_mtp = pipeline.layer_costs(layers)
    assert with_mtp > head_only + 1.0
    assert pipeline.stage_rank(3, 2, "interleaved-1f1b") == 1 and pipeline.stage_rank(3, 2, "zbv") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("pad_values", [None, True, False], ids=["chosen", "padded", "as-they-are"])
def test_mla_head_dims_run_on_a_fused_kernel_in_bf16_and_compile_whole(pad_values):
    """DeepSeek's head dims (q/k 192, v 128) in bf16: a fused SDPA kernel (cuDNN taking them as they
    are, or flash/cuDNN on padded values, never math), eager and compiled in one graph (the kernel
    question is answered while tracing), within bf16 rounding of fp32 math attention."""
    import functools

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.context import causal_attention
    from parallel.context import CUDA_ATTENTION_PRIORITY
    from parallel.fused_attention import cudnn_takes_head_dims, fused_causal_attention

    if pad_values is False and not cudnn_takes_head_dims(torch.cuda.current_device(), torch.bfloat16, 192, 128, True):
        pytest.skip("cuDNN does not take head dims 192/128 with this torch and cuDNN")
    attention = functools.partial(fused_causal_attention, pad_values=pad_values)

    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 1024, 8, 192), (2, 1024, 8, 192), (2, 1024, 8, 128)]
    q, k, v = (torch.randn(s, generator=generator).cuda().bfloat16().requires_grad_() for s in shapes)
    grad = torch.randn(2, 1024, 8, 128, generator=generator).cuda().bfloat16()
    scale = 0.135
    full = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        reference = causal_attention(*full, scale=scale)
    reference.backward(grad.float())
    compiled = torch.compile(attention, fullgraph=True)
    for name, attend in (("eager", attention), ("compiled", compiled)):
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel(CUDA_ATTENTION_PRIORITY, set_priority=True), torch.profiler.profile() as prof:
            out = attend(q, k, v, None, scale)
            out.backward(grad)
        ops = {event.name for event in prof.events()}
        assert not any("math" in op for op in ops) and any(
            "cudnn_attention" in op or "flash_attention" in op for op in ops), (name, sorted(ops))
        for actual, expected in ((out, reference), (q.grad, full[0].grad), (k.grad, full[1].grad), (v.grad, full[2].grad)):
            error = ((actual.float() - expected).norm() / expected.norm()).item()
            assert error < 2e-2, (name, error)
