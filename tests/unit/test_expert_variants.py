"""The experts op's variants against transformers' own modules, fp32 on CPU: gpt-oss's biased
experts with the clamped SwiGLU and its biased top-k router (GptOssMLP), Llama 4's sigmoid top-1
router whose score scales the expert's input, beside the shared expert (Llama4TextMoe); the
grouped GEMM and the per-expert loop agree, biases included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import moe, spec
from models.context import ExpertBiases, LocalContext, grouped_swiglu
from models.config import ClampedSwiGLU
from models.presets import get_model_config


transformers = pytest.importorskip("transformers")


def _params(cfg, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return spec.unflatten({name: torch.randn(s.shape, generator=generator) * (0.5 if s.std else 0.2)
                           for name, s in spec.flatten(moe.moe_params(cfg, 1.0, 1.0))})


def test_gpt_oss_experts_and_router_are_transformers_gpt_oss_mlp():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = get_model_config("tiny-gpt-oss")
    p = _params(cfg, 0)
    hf_config = transformers.GptOssConfig(hidden_size=cfg.dim, intermediate_size=cfg.expert_ffn_dim,
                                          num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k)
    mlp = GptOssMLP(hf_config)
    experts = p["experts"]
    with torch.no_grad():
        mlp.router.weight.copy_(p["router"])
        mlp.router.bias.copy_(p["router_logit_bias"])
        # HF's [E, in, out] with gate and up interleaved along out.
        gate_up = torch.stack([experts["w_gate"], experts["w_up"]], dim=2).flatten(1, 2)  # [E, 2F, D], interleaved rows
        mlp.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
        mlp.experts.gate_up_proj_bias.copy_(torch.stack([experts["b_gate"], experts["b_up"]], dim=2).flatten(1, 2))
        mlp.experts.down_proj.copy_(experts["w_down"].transpose(1, 2))
        mlp.experts.down_proj_bias.copy_(experts["b_down"])
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(1)) * 3  # past the clamp
    with torch.no_grad():
        expected, _ = mlp(x)
        ours = moe.moe_forward(p, x, cfg, LocalContext())
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_llama4_router_and_experts_are_transformers_llama4_moe():
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    cfg = get_model_config("tiny-llama4")
    p = _params(cfg, 2)
    hf_config = transformers.Llama4TextConfig(hidden_size=cfg.dim, intermediate_size=cfg.expert_ffn_dim,
                                              num_local_experts=cfg.num_experts, num_experts_per_tok=1)
    layer = Llama4TextMoe(hf_config)
    with torch.no_grad():
        layer.router.weight.copy_(p["router"])
        layer.experts.gate_up_proj.copy_(torch.cat([p["experts"]["w_gate"], p["experts"]["w_up"]], 1).transpose(1, 2))
        layer.experts.down_proj.copy_(p["experts"]["w_down"].transpose(1, 2))
        for name, hf_name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            getattr(layer.shared_expert, hf_name).weight.copy_(p["shared"][name])
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, _ = layer(x)
        ours = moe.moe_forward(p, x, cfg, LocalContext())
    torch.testing.assert_close(ours, expected.view_as(x), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_with_biases_and_the_clamped_unit_equals_the_expert_loop():
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm")
    generator = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 5, 1])
    e, f, d = len(counts), 24, 16
    x = torch.randn(int(counts.sum()), d, generator=generator) * 3
    weights = [torch.randn(e, f, d, generator=generator) * 0.3, torch.randn(e, f, d, generator=generator) * 0.3,
               torch.randn(e, d, f, generator=generator) * 0.3]
    biases = [torch.randn(e, f, generator=generator), torch.randn(e, f, generator=generator),
              torch.randn(e, d, generator=generator)]
    grad_out = torch.randn(x.shape[0], d, generator=generator)
    results = []
    for use_grouped_mm in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x, *weights, *biases)]
        try:
            out = grouped_swiglu(inputs[0], counts, *inputs[1:4], use_grouped_mm=use_grouped_mm,
                                 biases=ExpertBiases(*inputs[4:]), glu=ClampedSwiGLU())
        except RuntimeError as error:
            pytest.skip(f"grouped_mm does not run on CPU fp32 here: {error}")
        out.backward(grad_out)
        results.append([out, *(t.grad for t in inputs)])
    for name, grouped, loop in zip(("out", "dx", "dw_gate", "dw_up", "dw_down", "db_gate", "db_up", "db_down"),
                                   *results):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5, msg=name)
