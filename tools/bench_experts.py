"""The routed experts' SwiGLU on one GPU, forward and backward, in each way dtrain could run it:
torch's bf16 grouped GEMM (what `ModelContext.experts` runs), eager and compiled; dtrain's
`--fp8-experts` with torchao (parallel/fp8_experts.py: aligned rows, rowwise casts, FP8 grouped
GEMMs), eager and compiled; Transformer Engine's grouped GEMM in bf16 and in its FP8 recipes
(te.GroupedLinear: gate and up as one projection, then down) and dtrain's TE op
(parallel/te_experts.py), where TE is installed; at each MoE benchmark shape's routed rows
(micro-batch 2 x 4096 tokens, top_k rows per token, every expert given the same load):

    python -m tools.bench_experts [--setups mixtral-small deepseek-v2-lite] [--iters 20] \
        [--ways torch "torchao rowwise"] >> benchmarks/experts.jsonl

One JSON line per shape and way (then a markdown table): milliseconds per forward + backward and
TFLOP/s (3 matmuls of 2 x rows x dim x expert_ffn_dim FLOPs each, three times over for the
backward). An FP8 way must beat the bf16 kernel with its casts included; its rows are what the
planner's FP8 grouped-GEMM rate (dtrain/planner/hardware.py) is to be fitted on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F

from models.context import grouped_swiglu
from models.presets import get_model_config
from parallel import te_linear
from tools.commit import commit_hash
from tools.bench_attention import cuda_ms_per_call

SHAPES = ("mixtral-small", "deepseek-v2-lite")
TOKENS = 2 * 4096
TE_RECIPES = ("delayed", "current", "blockwise")


def _rows_and_counts(shape: str) -> tuple[int, int, int, torch.Tensor]:
    cfg = get_model_config(shape)
    rows = TOKENS * cfg.top_k
    if rows % cfg.num_experts:
        raise SystemExit(f"{shape}: {rows} routed rows do not split evenly over {cfg.num_experts} experts")
    counts = torch.full((cfg.num_experts,), rows // cfg.num_experts, dtype=torch.int64)
    return cfg.dim, cfg.expert_ffn_dim, rows, counts


def _experts_inputs(dim: int, ffn: int, rows: int, counts: torch.Tensor):
    """The rows, their counts and the [experts, out, in] weights as dtrain holds them, and a gradient."""
    experts = counts.numel()

    def weight(out_features, in_features):
        return (torch.randn(experts, out_features, in_features, device="cuda") / in_features ** 0.5).to(
            torch.bfloat16).requires_grad_()

    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    return x, counts.cuda(), (weight(ffn, dim), weight(ffn, dim), weight(dim, ffn)), grad


def torch_step(dim: int, ffn: int, rows: int, counts: torch.Tensor, compiled: bool = False):
    x, counts, weights, grad = _experts_inputs(dim, ffn, rows, counts)
    experts = torch.compile(grouped_swiglu) if compiled else grouped_swiglu

    def step():
        experts(x, counts, *weights, use_grouped_mm=True).backward(grad)
    return step


def fp8_grouped_step(dim: int, ffn: int, rows: int, counts: torch.Tensor, compiled: bool = False):
    """dtrain's torchao FP8 experts (parallel/fp8_experts.py: aligned rows, rowwise casts, FP8
    grouped GEMMs) on the same inputs as `torch_step`, the casts and padding included."""
    from parallel.fp8_experts import Fp8GroupedExperts

    x, counts, weights, grad = _experts_inputs(dim, ffn, rows, counts)
    experts = Fp8GroupedExperts(native=True)
    if compiled:
        experts = torch.compile(experts)

    def step():
        experts(x, counts, *weights).backward(grad)
    return step


def dtrain_te_step(dim: int, ffn: int, rows: int, counts: torch.Tensor, recipe: str):
    """dtrain's `--fp8-experts` op (parallel/te_experts.py) on the same inputs as `torch_step`."""
    from parallel.te_experts import for_layers

    x, counts, weights, grad = _experts_inputs(dim, ffn, rows, counts)
    experts = for_layers(te_linear.TELinear(recipe, torch.device("cuda")), {"layer": counts.numel()})["layer"]

    def step():
        experts(x, counts, *weights).backward(grad)
    return step


def te_step(dim: int, ffn: int, rows: int, counts: torch.Tensor, recipe: str | None):
    te = te_linear.import_te()
    experts = counts.numel()
    gate_up = te.GroupedLinear(experts, dim, 2 * ffn, bias=False, params_dtype=torch.bfloat16, device="cuda")
    down = te.GroupedLinear(experts, ffn, dim, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    splits = counts.tolist()

    def step():
        with te.autocast(enabled=recipe is not None, recipe=te_linear.make_recipe(recipe) if recipe else None):
            gate, up = gate_up(x, splits).chunk(2, dim=-1)
            out = down(F.silu(gate) * up, splits)
        out.backward(grad)
    return step


def run(shapes: list[str], iters: int, only: list[str] = ()) -> list[dict]:
    results = []
    for shape in shapes:
        dim, ffn, rows, counts = _rows_and_counts(shape)
        ways = {"torch bf16 grouped_mm": lambda: torch_step(dim, ffn, rows, counts),
                "torch bf16 grouped_mm compiled": lambda: torch_step(dim, ffn, rows, counts, compiled=True),
                "dtrain --fp8-experts torchao rowwise": lambda: fp8_grouped_step(dim, ffn, rows, counts),
                "dtrain --fp8-experts torchao rowwise compiled": lambda: fp8_grouped_step(dim, ffn, rows, counts,
                                                                                          compiled=True),
                "te bf16 GroupedLinear": lambda: te_step(dim, ffn, rows, counts, None),
                **{f"te {r} GroupedLinear": (lambda r=r: te_step(dim, ffn, rows, counts, r)) for r in TE_RECIPES},
                "dtrain --fp8-experts delayed": lambda: dtrain_te_step(dim, ffn, rows, counts, "delayed")}
        flops = 3 * 3 * 2 * rows * dim * ffn
        for way, make in ways.items():
            if only and not any(part in way for part in only):
                continue
            try:
                ms = cuda_ms_per_call(make(), iters)
                row = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
            except Exception as error:  # one way failing (a recipe the GPU lacks) leaves the others
                row = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            results.append({"kind": "experts", "shape": shape, "way": way, "rows": rows, "experts": counts.numel(), "dim": dim,
                            "expert_ffn_dim": ffn, **row, "torch": torch.__version__,
                            "device": torch.cuda.get_device_name(), "commit": commit_hash(),
                            "date": datetime.date.today().isoformat()})
            print(json.dumps(results[-1]), flush=True)
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_experts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ways", nargs="+", default=[], help="only the ways whose name contains one of these")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the experts benchmark needs a CUDA GPU")
    results = run(args.setups, args.iters, args.ways)
    print("| shape | way | ms fwd+bwd | TFLOP/s |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['way']} | {r.get('ms', r.get('error'))} | {r.get('tflops', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
