"""`python -m dtrain.planner`: the best layouts of a model on a number of GPUs, a given layout
evaluated, or the models against measured and published runs.

    python -m dtrain.planner --model llama3-70b --gpus 1024 --gpu h100-sxm \\
        --seq-len 8192 --global-batch 1024 [--fp8 tensorwise] [--top 3] [--json]
    python -m dtrain.planner --model llama3-70b --gpus 64 --gpu h100-sxm --seq-len 8192 --global-batch 128 \\
        --mesh pp=8,dp_shard=2,tp=4 --pp-virtual-stages 5 --dp-mode zero1   # this layout: fits? how fast? why?
    python -m dtrain.planner --model llama3-8b --gpus 64 --global-batch 256 \\
        --fp8 delayed --fp8-backend te --fp8-head          # Transformer Engine's FP8, the head too
    python -m dtrain.planner --validate benchmarks/results.jsonl [--readme README.md]
    python -m dtrain.planner --published benchmarks/published_runs.jsonl [--readme docs/planner.md]
    python -m dtrain.planner --profiles                    # the GPU profiles and their rates
    python -m dtrain.planner --refresh docs/planner.md     # every planner output a page shows, again

`--mesh` fixes the mesh, and each of --micro-batch, --recompute, --recompute-layers,
--pp-schedule, --pp-virtual-stages, --dp-mode, --fsdp-reshard-after-forward and --cpu-offload
fixes that choice; the rest is searched. A fixed layout that fits in no way is still reported,
with its memory per rank, as not fitting. With --readme, the output is also written into that
file between the markers that name the same command (`<!-- python -m dtrain.planner ARGS -->` ...
`<!-- end of python -m dtrain.planner -->`); --refresh PAGE runs every command whose marker the page
has and writes each output there.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

import attrs

from dtrain.config import ParallelArgs, TrainArgs
from dtrain.planner import gpus
from dtrain.planner.candidates import Fixed, Target
from dtrain.planner.hardware import H200
from dtrain.planner.report import END_MARKER, candidates_text, write_into_readme
from dtrain.planner.search import nothing_fits, search
from models.errors import UserError
from parallel.precision import FP8_RECIPES

__all__ = ["END_MARKER", "main"]


def _choices(group, name: str) -> tuple[str, ...]:
    return attrs.fields_dict(group)[name].metadata["choices"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dtrain.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model preset (python -m dtrain.run --help lists them)")
    parser.add_argument("--model-overrides", default="", help="changes to the preset's shape, e.g. num_layers=40")
    parser.add_argument("--gpus", type=int, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", choices=list(gpus.DATASHEETS), default=None,
                        help="the GPU's profile (--profiles lists them; default: the GPU this machine has, else "
                             f"{gpus.DEFAULT})")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="usable memory per GPU (default: the profile's)")
    parser.add_argument("--inter-node-gb-s", type=float, default=None,
                        help="network bandwidth per GPU between nodes, GB/s (default: the profile's)")
    parser.add_argument("--host-memory-gb", type=float, default=H200.host_memory_gb,
                        help="host memory per node, for CPU offload")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step")
    parser.add_argument("--fp8", choices=[recipe for recipes in FP8_RECIPES.values() for recipe in recipes],
                        default=None, help="FP8 matmuls in the blocks, as dtrain.run takes them")
    parser.add_argument("--fp8-backend", choices=list(FP8_RECIPES), default="torchao",
                        help="whose FP8: torchao's recipes, or Transformer Engine's (te); TE's matmuls keep bf16 "
                        "activations, so its layouts need more memory")
    parser.add_argument("--fp8-head", action="store_true", help="under --fp8, the output projection in FP8 too")
    parser.add_argument("--fp8-experts", action="store_true",
                        help="the routed experts' grouped GEMMs in FP8 (torchao's, or with --fp8-backend te TE's)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=0,
                        help="the output projection and loss this many tokens at a time (dtrain.run's flag; 0: all)")
    fixed = parser.add_argument_group("a given layout (each fixes that choice; the rest is searched)")
    fixed.add_argument("--mesh", help="the mesh, as dtrain.run takes it (e.g. pp=8,dp_shard=2,tp=4)")
    fixed.add_argument("--micro-batch", type=int)
    fixed.add_argument("--recompute", choices=_choices(TrainArgs, "recompute"))
    fixed.add_argument("--recompute-layers", type=int)
    fixed.add_argument("--pp-schedule", choices=_choices(ParallelArgs, "pp_schedule"))
    fixed.add_argument("--pp-virtual-stages", type=int)
    fixed.add_argument("--dp-mode", choices=_choices(ParallelArgs, "dp_mode"))
    fixed.add_argument("--fsdp-reshard-after-forward", choices=_choices(ParallelArgs, "fsdp_reshard_after_forward"))
    fixed.add_argument("--cpu-offload", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--top", type=int, default=3, help="how many candidates to print")
    parser.add_argument("--json", action="store_true", help="a JSON list of the candidates, best first")
    parser.add_argument("--validate", type=Path, metavar="RESULTS",
                        help="predicted against measured peak memory and tokens/s for a benchmark JSON-lines file")
    parser.add_argument("--published", type=Path, metavar="RUNS",
                        help="predicted against published tokens/s of runs at scale (benchmarks/published_runs.jsonl)")
    parser.add_argument("--profiles", action="store_true", help="the GPU profiles: datasheet figures and rates")
    parser.add_argument("--readme", type=Path, help="also write the output into this file between its markers")
    parser.add_argument("--refresh", type=Path, metavar="PAGE",
                        help="run every planner command whose marker PAGE has and write its output there")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.refresh:
            for command in refresh(args.refresh):
                print(f"wrote the output of {command} into {args.refresh}")
            return 0
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
    if args.profiles:
        return gpus.profiles_table()
    for flag, path in (("--validate", args.validate), ("--published", args.published)):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file")
    if args.validate:
        from dtrain.planner.measured import validation_text

        return validation_text(args.validate)
    if args.published:
        from dtrain.planner.published import published_text

        return published_text(args.published)
    target = target_of(args)
    started = time.perf_counter()
    candidates = search(target)
    seconds = time.perf_counter() - started
    if not candidates:
        raise UserError(nothing_fits(target))
    if args.json:
        return json.dumps([c.as_json() for c in candidates[:max(args.top, 1)]], indent=1)
    return candidates_text(target, candidates, args.top, seconds)


def refresh(page: Path) -> list[str]:
    """Runs each `python -m dtrain.planner ARGS` whose marker `page` has and writes its output
    between that marker and the end marker after it; returns the commands."""
    if not page.is_file():
        raise UserError(f"--refresh {page}: no such file")
    commands = re.findall(r"<!-- (python -m dtrain\.planner [^>]*?) -->", page.read_text())
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[3:])
        write_into_readme(page, command, run(args))
    return commands


def target_of(args: argparse.Namespace) -> Target:
    """The target of the command line, checked."""
    for name in ("model", "gpus", "global_batch"):
        if getattr(args, name) is None:
            raise UserError(f"--{name.replace('_', '-')} is needed (or --validate RESULTS, --published RUNS)")
    if min(args.gpus, args.seq_len, args.global_batch, args.gpus_per_node, args.top) < 1 or min(
            args.gpu_memory_gb or 1, args.inter_node_gb_s or 1, args.host_memory_gb) <= 0:
        raise UserError("--gpus, --gpus-per-node, --seq-len, --global-batch, --top, --gpu-memory-gb, "
                        "--inter-node-gb-s and --host-memory-gb must be positive")
    for flag, value in (("--micro-batch", args.micro_batch), ("--pp-virtual-stages", args.pp_virtual_stages)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} must be >= 1")
    if args.recompute_layers is not None and args.recompute_layers < 0:
        raise UserError(f"--recompute-layers {args.recompute_layers} must be >= 0")
    fixed = Fixed(mesh=args.mesh, micro_batch=args.micro_batch, recompute=args.recompute,
                  recompute_layers=args.recompute_layers, pp_schedule=args.pp_schedule,
                  pp_virtual_stages=args.pp_virtual_stages, fsdp_reshard_after_forward=args.fsdp_reshard_after_forward,
                  cpu_offload=args.cpu_offload, dp_mode=args.dp_mode)
    target = Target(model=args.model, gpus=args.gpus, seq_len=args.seq_len, global_batch=args.global_batch,
                    gpu=args.gpu or gpus.detect(), gpu_memory_gb=args.gpu_memory_gb, gpus_per_node=args.gpus_per_node,
                    model_overrides=args.model_overrides, fp8=args.fp8, fp8_backend=args.fp8_backend,
                    fp8_head=args.fp8_head, fp8_experts=args.fp8_experts, loss_chunk_tokens=args.loss_chunk_tokens,
                    inter_node_gb_s=args.inter_node_gb_s, host_memory_gb=args.host_memory_gb, fixed=fixed)
    return target


if __name__ == "__main__":
    sys.exit(main())
