"""Benchmark a model and mesh on synthetic data; prints one JSON line per run.

    python -m tools.bench --shape llama-1b --steps 30 -- --compile
    torchrun --nproc_per_node 2 -m tools.bench --shape llama-8b -- --mesh dp=2

Throughput is the median over the steps after `--warmup` (compilation excluded); MFU is model FLOPs
per token (models/flops.py) over the dense BF16 peak. Packed documents need no dataset: `-- --document-mask --synthetic-document-length
2048` packs synthetic documents of random lengths (mean 2048) into every sample; the JSON line then
also has `mfu_document_attention_pct`, the MFU of the attention the documents needed. Arguments after `--` go to dtrain's own CLI (`python -m dtrain.run --help`).
`--table FILE` renders the JSON lines of FILE as a markdown table instead, and with
`--readme README.md` writes it between the README's benchmark markers (and, where the README has
its markers, the breakdown of the newest profiled run of each setup beside its ceiling).

`--profile DIR` profiles 3 steps after warm-up and writes where each rank's time went: every
kernel in one category (GEMMs, attention, the loss, element-wise and norms, the optimizer, FSDP's
copies, other, communication) or idle (dtrain/diagnose/breakdown.py), beside the ceiling of the
step, its GEMMs and attention alone at the planner's rates (dtrain/planner/steptime.py). Every JSON
line carries the ceiling; a profiled one carries rank 0's breakdown too.

`--attention SETUP|all` times attention sub-blocks alone instead, llama-1b's GQA beside DeepSeek's
MLA (tools/bench_attention.py); `--experts [WAY ...]` the routed experts alone, bf16 beside FP8
(tools/bench_experts.py).

`--bubble FILE` measures pipeline bubbles from the JSON lines of FILE: two runs of the same
pipelined setup with m and 2m micro-batches per step give the time of one micro-batch,
t = (T(2m) - T(m)) / m, and the bubble of the m-run is 1 - m*t / T(m) (everything that does not
grow with the micro-batches: fill and drain, and the optimizer step). It is shown beside the
schedule's ideal, (p-1)/(m+p-1), or (p-1)/(v*m+p-1) with v stages per rank.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
from pathlib import Path

from models.errors import UserError
from tools.bench_tables import bubbles, companion_tables, ms_text, table, write_into_readme
from tools.commit import commit_hash
from tools.shapes import CPU_SHAPES, SHAPES


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


PROFILED_STEPS = 3
# Set by tools.bench_suite for the processes of one call; every row of the call carries it.
CALL_ENV = "DTRAIN_BENCH_CALL"


class Profiler:
    """Profiles PROFILED_STEPS steps after warm-up (fewer where the run ends sooner) and writes to
    `out_dir`, per rank, where their time went (dtrain/diagnose/breakdown.py) beside the step's
    ceiling, and the ops and kernels with the most time."""

    def __init__(self, out_dir: Path | None, first_step: int, ceiling=lambda: None):
        self.out_dir, self.first_step, self.ceiling = out_dir, first_step, ceiling
        self.profiler = None
        self.breakdown = None  # this rank's, once profiled

    def __call__(self, step: int) -> None:
        import torch

        if self.out_dir is None:
            return
        if step == self.first_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif step == self.first_step + PROFILED_STEPS:
            self.finish(PROFILED_STEPS)

    def finish(self, steps: int) -> None:
        """Stops the profiler after `steps` steps (all of them complete) and writes its files."""
        import torch

        from dtrain.diagnose import breakdown as profile_breakdown

        if self.profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        rank = os.environ.get("RANK", "0")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.breakdown = profile_breakdown.breakdown(
            profile_breakdown.profile_activities(self.profiler.profiler.kineto_results.events()), steps)
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=sort, row_limit=40)
        ceiling = self.ceiling()
        (self.out_dir / f"profile_rank{rank}.txt").write_text(
            f"{self.breakdown.table()}\n{ceiling_line(ceiling)}\n\n{table}")
        (self.out_dir / f"profile_rank{rank}.json").write_text(
            json.dumps({"rank": int(rank), **self.breakdown.as_dict(), "ceiling": ceiling}) + "\n")
        self.profiler = None


def ceiling_line(ceiling: dict | None) -> str:
    """The ceiling of a step in words (dtrain/planner/steptime.py's Ceiling.as_dict)."""
    if ceiling is None:
        return "ceiling: -"
    bubble = f" + bubble {ms_text(ceiling['bubble_s'])}" if ceiling["bubble_s"] else ""
    return (f"ceiling, GEMMs and attention alone at the planner's H200 rates (dtrain/planner/hardware.py): "
            f"{ms_text(ceiling['seconds'])} ms per step (GEMMs {ms_text(ceiling['gemm_s'])} + attention "
            f"{ms_text(ceiling['attention_s'])}{bubble}), {ceiling['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, "
            f"MFU {ceiling['mfu_pct']:.1f}%")


def inductor_settings(items: list[str]) -> dict:
    """`KEY=VALUE` pairs of torch._inductor.config, each VALUE a Python literal."""
    import ast

    import torch._inductor.config as config

    settings = {}
    for item in items:
        key, _, value = item.partition("=")
        if not hasattr(config, key) or not value:
            raise ValueError(f"--inductor {item}: give KEY=VALUE with a torch._inductor.config KEY")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--inductor {item}: {value!r} is not a Python literal") from None
    return settings


def run(shape: str, steps: int, warmup: int, extra: list[str], profile_dir: Path | None = None,
        baseline: bool = False, inductor: dict | None = None) -> dict | None:
    import attrs
    import torch

    from dtrain.config import load_config
    from dtrain.layout import Machine
    from dtrain.planner import advice, steptime
    from dtrain.train import train

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    argv = [*SHAPES[shape], "--data", "synthetic", "--steps", str(steps), "--warmup-steps", "2", "--lr", "3e-4",
            "--run-dir", f"runs/bench-{shape}", "--overwrite", "--no-final-checkpoint"]
    given = load_config(argv + extra)
    layout = advice.resolve_run(given, world_size, Machine.detect())
    # The row records the flags as given (--mesh auto stays auto), with the batch the run took.
    taken = layout.config.data
    config = attrs.evolve(given, data=attrs.evolve(given.data, micro_batch=taken.micro_batch,
                                                   global_batch=taken.global_batch))
    if baseline:
        _check_baseline(layout)
    import torch._inductor.config as inductor_config

    for key, value in (inductor or {}).items():
        setattr(inductor_config, key, value)

    @functools.cache
    def ceiling() -> dict:
        """The run's step with only its GEMMs and attention at the planner's rates."""
        return steptime.ceiling(layout).as_dict()

    profiler = Profiler(profile_dir, warmup, ceiling)
    history = train(layout, before_step=profiler)
    profiler.finish(max(1, len(history) - warmup))
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    timed = history[warmup:]
    if not timed:  # stopped early, e.g. by SIGTERM (it saves and stops)
        raise SystemExit(f"error: the run stopped after {len(history)} steps, before any timed step "
                         f"(--warmup {warmup})")
    tok = statistics.median(h["perf/tokens_per_sec_per_gpu"] for h in timed)
    result = {
        "shape": shape, "model": config.model.model, "mesh": config.parallel.mesh or "single",
        "gpus": world_size, "seq_len": config.data.seq_len, "micro_batch": config.data.micro_batch,
        "global_batch": config.data.global_batch, "precision": config.train.precision,
        "compile": config.train.compile, "recompute": config.train.recompute,
        "tokens_per_sec_per_gpu": round(tok, 1),
        "median_step_s": round(config.data.global_batch * config.data.seq_len / tok / world_size, 4),
        "mfu_pct": round(statistics.median(h["perf/mfu"] for h in timed), 2) if "perf/mfu" in timed[0] else None,
        "mfu_document_attention_pct": (round(statistics.median(h["perf/mfu_document_attention"] for h in timed), 2)
                                       if "perf/mfu_document_attention" in timed[0] else None),
        "peak_mem_gb": round(max(h["mem/peak_gb"] for h in timed), 2),
        # With --profile, rank 0's: the share of the profiled steps' wall time in which only
        # communication kernels ran, and where the steps' time went.
        "exposed_communication_pct": (round(profiler.breakdown.exposed_communication_pct, 2)
                                      if profiler.breakdown is not None else None),
        "profile": profiler.breakdown.as_dict() if profiler.breakdown is not None else None,
        # The step if only its GEMMs and attention ran, at the planner's H200 rates.
        "ceiling": ceiling(),
        "final_loss": round(history[-1]["train/loss"], 4), "steps": steps, "warmup": warmup,
        "args": extra, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": commit_hash(), "date": datetime.date.today().isoformat(),
        # The tools.bench_suite call that ran it: rows of one call compare fairly (the same machine).
        "call": os.environ.get(CALL_ENV),
        "inductor": inductor or None,
    }
    if baseline:
        del history, timed
        result["baseline"] = run_baseline_beside(layout, steps, warmup)
        result["vs_baseline"] = round(tok / result["baseline"]["tokens_per_sec_per_gpu"], 3)
    print(json.dumps(result), flush=True)
    return result


def _check_baseline(layout) -> None:
    """Before the dtrain run: the baseline can run this setup (one process, a plain Llama)."""
    from tools.baseline import unsupported

    if layout.world_size != 1:
        raise SystemExit(f"error: --baseline runs on one GPU; this run has {layout.world_size} processes")
    reason = unsupported(layout.model_cfg, layout.config.data.document_mask)
    if reason:
        raise SystemExit(f"error: --baseline is a plain Llama and runs none of: {reason}; drop --baseline")


def run_baseline_beside(layout, steps: int, warmup: int) -> dict:
    """The plain PyTorch baseline (tools/baseline.py) at the model, shape, batch and precision
    that `layout` runs, once dtrain's run has given back its memory. FP8 runs take torchao's
    recipe where they name one, else tensorwise (Transformer Engine's recipes)."""
    import gc

    import torch

    from parallel.precision import TORCHAO_RECIPES
    from tools.baseline import run_baseline

    gc.collect()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch._dynamo.reset()  # the run's compiled graphs, and what their caches still hold
        gc.collect()
        torch.cuda.empty_cache()
    d, t = layout.config.data, layout.config.train
    fp8 = None if t.fp8 is None else t.fp8 if t.fp8 in TORCHAO_RECIPES else "tensorwise"
    return run_baseline(layout.model_cfg, seq_len=d.seq_len, micro_batch=d.micro_batch, global_batch=d.global_batch,
                        steps=steps, warmup=warmup, compile_=t.compile, precision=t.precision, fp8=fp8,
                        fp8_head=t.fp8_head, device=device, seed=t.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help=f"profile {PROFILED_STEPS} steps after warm-up; write where each rank's time went "
                        "and its top kernels to DIR (profile_rank<r>.txt and .json), and rank 0's breakdown "
                        "into the JSON line")
    parser.add_argument("--baseline", action="store_true",
                        help="after the run, time the plain PyTorch baseline (tools/baseline.py) at the same model, "
                        "shape, batch and precision in this process; the JSON line carries it and the ratio")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                        help="set torch._inductor.config KEY to VALUE (a Python literal) before the run, to measure "
                        "compiler settings (cpp_wrapper=True: kernels launched from C++); the row records them")
    parser.add_argument("--table", type=Path, help="print the markdown table of a JSON-lines file and exit")
    parser.add_argument("--bubble", type=Path, metavar="FILE",
                        help="print the measured pipeline bubbles of the runs in a JSON-lines file and exit")
    parser.add_argument("--readme", type=Path, help="with --table or --bubble: also write the table into this "
                        "file, between its markers (see tools.bench_tables.README_MARKERS)")
    parser.add_argument("--attention", metavar="SETUP", help="time attention sub-blocks alone, forward + backward: "
                        "setups of tools/bench_attention.py (comma-separated), or all; then exit")
    parser.add_argument("--attention-batch", type=int, default=4)
    parser.add_argument("--attention-seq-len", type=int, default=4096)
    parser.add_argument("--compile", action="store_true", help="with --attention: compile each sub-block")
    parser.add_argument("--experts", nargs="*", metavar="WAY", help="time the routed experts alone, forward + "
                        "backward, at the MoE shapes (tools/bench_experts.py): the ways whose names contain one of "
                        "these (all without any), --steps calls each; then exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.experts is not None:
        from tools import bench_experts

        bench_experts.main(["--iters", str(args.steps), *(["--ways", *args.experts] if args.experts else [])])
        return 0
    if args.attention:
        from tools import bench_attention

        names = list(bench_attention.SETUPS) if args.attention == "all" else args.attention.split(",")
        unknown = [name for name in names if name not in bench_attention.SETUPS]
        if unknown:
            parser.error(f"--attention {unknown[0]}: choose one of {', '.join(bench_attention.SETUPS)} or all")
        bench_attention.run(names, args.attention_batch, args.attention_seq_len, args.steps, args.compile)
        return 0
    for kind, source, render in (("table", args.table, table), ("bubble", args.bubble, bubbles)):
        if source:
            try:  # every table rendered before the README is touched
                rendered = render(source)
                companions = companion_tables(args.readme, source) if args.readme and kind == "table" else {}
            except UserError as error:
                parser.error(str(error))
            if args.readme:
                for written, text in {kind: rendered, **companions}.items():
                    write_into_readme(args.readme, written, text)
            print(rendered)
            return 0
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.shape not in CPU_SHAPES and not _has_cuda():
        parser.error(f"--shape {args.shape} is measured on GPUs and this machine has none; "
                     f"--shape {' or '.join(CPU_SHAPES)} runs on CPU")
    if args.profile is not None:
        try:  # before the run, rather than losing its profile at the end
            args.profile.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--profile {args.profile}: {error.strerror}; give a directory this process can write")
    try:
        inductor = inductor_settings(args.inductor)
    except ValueError as error:
        parser.error(str(error))
    run(args.shape, args.steps, args.warmup, extra, args.profile, args.baseline, inductor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
