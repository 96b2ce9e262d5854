"""`python -m dtrain.planner`: the best layouts of a model on a number of GPUs, or the memory and
step-time models against the measured benchmark rows.

    python -m dtrain.planner --model llama3-70b --gpus 1024 --gpus-per-node 8 --gpu-memory-gb 80 \\
        --seq-len 8192 --global-batch 1024 [--fp8 tensorwise] [--top 3] [--json]
    python -m dtrain.planner --model llama3-8b --gpus 64 --global-batch 256 \\
        --fp8 delayed --fp8-backend te --fp8-head          # Transformer Engine's FP8, the head too
    python -m dtrain.planner --validate benchmarks/results.jsonl [--readme README.md]

With --readme, the output is also written into that file between the markers that name the
same command (`<!-- python -m dtrain.planner ARGS -->` ... `<!-- end of python -m dtrain.planner -->`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dtrain.planner.hardware import H200
from dtrain.planner.search import Candidate, Target, fp8_flags, nothing_fits, search
from dtrain.layout.checks import check_experts, check_head
from models.errors import UserError
from models.presets import get_model_config
from parallel.precision import FP8_RECIPES, check_fp8_recipe

END_MARKER = "<!-- end of python -m dtrain.planner -->"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dtrain.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model preset (python -m dtrain.run --help lists them)")
    parser.add_argument("--model-overrides", default="", help="changes to the preset's shape, e.g. num_layers=40")
    parser.add_argument("--gpus", type=int, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="usable memory per GPU")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step")
    parser.add_argument("--fp8", choices=[recipe for recipes in FP8_RECIPES.values() for recipe in recipes],
                        default=None, help="FP8 matmuls in the blocks, as dtrain.run takes them")
    parser.add_argument("--fp8-backend", choices=list(FP8_RECIPES), default="torchao",
                        help="whose FP8: torchao's recipes, or Transformer Engine's (te); TE's matmuls keep bf16 "
                        "activations, so its layouts need more memory")
    parser.add_argument("--fp8-head", action="store_true", help="under --fp8, the output projection in FP8 too")
    parser.add_argument("--fp8-experts", action="store_true",
                        help="with --fp8-backend te, the routed experts' grouped GEMMs in FP8 too")
    parser.add_argument("--loss-chunk-tokens", type=int, default=0,
                        help="the output projection and loss this many tokens at a time (dtrain.run's flag; 0: all)")
    parser.add_argument("--inter-node-gb-s", type=float, default=H200.inter_node_gb_s,
                        help="network bandwidth per GPU between nodes, GB/s")
    parser.add_argument("--host-memory-gb", type=float, default=H200.host_memory_gb,
                        help="host memory per node, for CPU offload")
    parser.add_argument("--top", type=int, default=3, help="how many candidates to print")
    parser.add_argument("--json", action="store_true", help="a JSON list of the candidates, best first")
    parser.add_argument("--validate", type=Path, metavar="RESULTS",
                        help="predicted against measured peak memory and tokens/s for a benchmark JSON-lines file")
    parser.add_argument("--readme", type=Path, help="also write the output into this file between its markers")
    return parser


def describe(candidate: Candidate, rank: int, gpu_memory_gb: float) -> list[str]:
    """A few lines per candidate: the layout, memory per rank, speed, and the command."""
    p, t = candidate.config.parallel, candidate.config.train
    layout = [f"micro-batch {candidate.config.data.micro_batch}", f"recompute {candidate.recompute}"]
    if "pp=" in candidate.mesh:
        layout.append(f"{p.pp_schedule}" + (f" x{p.pp_virtual_stages} stages/rank" if p.pp_virtual_stages > 1 else ""))
    if p.fsdp_reshard_after_forward != "default":
        layout.append(f"reshard {p.fsdp_reshard_after_forward}")
    if p.cpu_offload:
        layout.append("CPU offload")
    if t.fp8:
        layout.append(" ".join(fp8_flags(t)))
    memory_line = candidate.memory.lines()[0]
    step = candidate.step
    return [
        f"{rank}. --mesh {candidate.mesh}: {', '.join(layout)}",
        f"   memory per rank {memory_line.replace(' GB at', f' of {gpu_memory_gb:g} GB at', 1)}",
        f"   {step.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU, MFU {100 * step.mfu():.1f}%, {step.seconds:.2f} s per step",
        f"   {candidate.command}",
    ]


def plan_text(target: Target, candidates: list[Candidate], top: int, seconds: float) -> str:
    nodes = max(1, target.gpus // target.gpus_per_node)
    fp8 = " ".join(fp8_flags(target))
    head = (f"{target.model} on {target.gpus} GPUs ({nodes} x {min(target.gpus, target.gpus_per_node)}, "
            f"{target.gpu_memory_gb:g} GB each), seq {target.seq_len}, global batch {target.global_batch}"
            f"{', ' + fp8 if fp8 else ''}: {len(candidates):,} layouts fit "
            f"(searched in {seconds:.1f} s); the best {min(top, len(candidates))}:")
    lines = [head, ""]
    for rank, candidate in enumerate(candidates[:top], 1):
        lines += describe(candidate, rank, target.gpu_memory_gb) + [""]
    return "\n".join(lines).rstrip()


def write_into_readme(readme: Path, command: str, text: str) -> None:
    """Replaces what follows the marker `<!-- COMMAND -->` up to the end marker with `text`."""
    begin = f"<!-- {command} -->"
    content = readme.read_text()
    if begin not in content:
        raise UserError(f"{readme} has no marker {begin!r}; add it, and {END_MARKER!r} after it, where the output goes")
    head, _, rest = content.partition(begin)
    if END_MARKER not in rest:
        raise UserError(f"{readme}: the marker {begin!r} has no {END_MARKER!r} after it")
    _, _, tail = rest.partition(END_MARKER)
    if not text.startswith("|"):
        text = f"```text\n{text}\n```"  # the planner's lines, kept as printed
    readme.write_text(f"{head}{begin}\n{text}\n{END_MARKER}{tail}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        text = run(args)
        if args.readme:
            without = [a for i, a in enumerate(argv) if a != "--readme" and (i == 0 or argv[i - 1] != "--readme")]
            write_into_readme(args.readme, " ".join(["python -m dtrain.planner", *without]), text)
    except UserError as error:
        print(f"dtrain.planner: error: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0


def run(args: argparse.Namespace) -> str:
    if args.validate:
        from dtrain.planner.measured import validation_text

        if not args.validate.is_file():
            raise UserError(f"--validate {args.validate}: no such file")
        return validation_text(args.validate)
    for name in ("model", "gpus", "global_batch"):
        if getattr(args, name) is None:
            raise UserError(f"--{name.replace('_', '-')} is needed (or --validate RESULTS)")
    if min(args.gpus, args.seq_len, args.global_batch, args.gpus_per_node, args.top) < 1 or min(
            args.gpu_memory_gb, args.inter_node_gb_s, args.host_memory_gb) <= 0:
        raise UserError("--gpus, --gpus-per-node, --seq-len, --global-batch, --top, --gpu-memory-gb, "
                        "--inter-node-gb-s and --host-memory-gb must be positive")
    check_head(args.fp8, args.fp8_head, args.loss_chunk_tokens)
    check_fp8_recipe(args.fp8, args.fp8_backend)
    target = Target(model=args.model, gpus=args.gpus, seq_len=args.seq_len, global_batch=args.global_batch,
                    gpu_memory_gb=args.gpu_memory_gb, gpus_per_node=args.gpus_per_node,
                    model_overrides=args.model_overrides, fp8=args.fp8, fp8_backend=args.fp8_backend,
                    fp8_head=args.fp8_head, fp8_experts=args.fp8_experts, loss_chunk_tokens=args.loss_chunk_tokens,
                    inter_node_gb_s=args.inter_node_gb_s, host_memory_gb=args.host_memory_gb)
    check_experts(target, get_model_config(args.model, args.model_overrides))
    started = time.perf_counter()
    candidates = search(target)
    seconds = time.perf_counter() - started
    if not candidates:
        raise UserError(nothing_fits(target))
    if args.json:
        return json.dumps([c.as_json() for c in candidates[:max(args.top, 1)]], indent=1)
    return plan_text(target, candidates, args.top, seconds)


if __name__ == "__main__":
    sys.exit(main())
