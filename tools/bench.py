"""Benchmark a model and mesh on synthetic data; prints one JSON line per run.

    python -m tools.bench --shape llama-1b --steps 30 -- --compile
    torchrun --nproc_per_node 2 -m tools.bench --shape llama-8b -- --mesh dp=2

Throughput is the median over the steps after `--warmup` (compilation excluded); MFU follows
BENCHMARKS.md. Packed documents need no dataset: `-- --document-mask --synthetic-document-length
2048` packs synthetic documents of random lengths (mean 2048) into every sample; the JSON line then
also has `mfu_document_attention_pct`, the MFU of the attention the documents needed. Arguments after `--` go to dtrain's own CLI (`python -m dtrain.run --help`).
`--table FILE` renders the JSON lines of FILE as a markdown table instead, and with
`--readme README.md` writes it between the README's benchmark markers (and, where the README has
its markers, the breakdown of the newest profiled run of each setup beside its ceiling).

`--profile DIR` profiles 3 steps after warm-up and writes where each rank's time went: every
kernel in one category (GEMMs, attention, the loss, element-wise and norms, the optimizer, FSDP's
copies, other, communication) or idle (tools/profile_breakdown.py), beside the ceiling of the
step, its GEMMs and attention alone at the planner's rates (dtrain/plan/steptime.py). Every JSON
line carries the ceiling; a profiled one carries rank 0's breakdown too.

`--attention SETUP|all` times attention sub-blocks alone instead, llama-1b's GQA beside DeepSeek's
MLA (tools/bench_attention.py).

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
import subprocess
import sys
from pathlib import Path

# Named shapes: model preset and the data shape that BENCHMARKS.md measures it with.
SHAPES = {
    "llama-1b": ["--model", "llama-1b", "--seq-len", "4096", "--micro-batch", "4"],
    "llama-3b": ["--model", "llama3.2-3b", "--seq-len", "8192", "--micro-batch", "1"],
    "llama-8b": ["--model", "llama3-8b", "--seq-len", "8192", "--micro-batch", "1"],
    # Four layers of Llama-3-70B (d=8192, FFN 28672, 64/8 heads): its matmul shapes on two GPUs.
    "llama-70b-4l": ["--model", "llama3-70b", "--model-overrides", "num_layers=4", "--seq-len", "8192",
                     "--micro-batch", "1"],
    "mixtral-small": ["--model", "mixtral-small", "--seq-len", "4096", "--micro-batch", "2"],
    # 15.7B parameters: fp32 master weights and AdamW (16 bytes/param) are ~126 GB per GPU over two,
    # which leaves little of an H200 for activations; `--model-overrides num_layers=14` keeps the
    # shape of each layer at half the depth.
    "deepseek-v2-lite": ["--model", "deepseek-v2-lite", "--seq-len", "4096", "--micro-batch", "1"],
    "tiny": ["--model", "tiny", "--seq-len", "256", "--micro-batch", "4"],
}


# Where --readme writes each rendering: between its begin and end markers.
README_MARKERS = {
    "table": ("<!-- benchmark table: python -m tools.bench --table benchmarks/results.jsonl --readme README.md -->",
              "<!-- end of benchmark table -->"),
    "bubble": ("<!-- bubble table: python -m tools.bench --bubble benchmarks/results.jsonl --readme README.md -->",
               "<!-- end of bubble table -->"),
    # Written with the table, where the README has these markers.
    "breakdown": ("<!-- step breakdown: python -m tools.bench --table benchmarks/results.jsonl --readme README.md -->",
                  "<!-- end of step breakdown -->"),
    "fp8 recipes": ("<!-- fp8 recipes: python -m tools.bench --table benchmarks/results.jsonl --readme README.md -->",
                    "<!-- end of fp8 recipes -->"),
    "fp8 curves": ("<!-- fp8 curves: python -m tools.bench --table benchmarks/results.jsonl --readme README.md -->",
                   "<!-- end of fp8 curves -->"),
}


def write_into_readme(readme: Path, kind: str, rendered: str) -> None:
    begin, end = README_MARKERS[kind]
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"error: {readme} lacks the markers {begin!r} and {end!r}; add them where the "
                         f"{kind} goes")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{begin}\n{rendered}\n{end}{tail}")


def commit_hash() -> str:
    if os.environ.get("DTRAIN_COMMIT"):
        return os.environ["DTRAIN_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


PROFILED_STEPS = 3


class Profiler:
    """Profiles PROFILED_STEPS steps after warm-up (fewer where the run ends sooner) and writes to
    `out_dir`, per rank, where their time went (tools/profile_breakdown.py) beside the step's
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

        from tools import profile_breakdown

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
    """The ceiling of a step in words (dtrain/plan/steptime.py's Ceiling.as_dict)."""
    if ceiling is None:
        return "ceiling: -"
    bubble = f" + bubble {_ms(ceiling['bubble_s'])}" if ceiling["bubble_s"] else ""
    return (f"ceiling, GEMMs and attention alone at the planner's H200 rates (dtrain/plan/hardware.py): "
            f"{_ms(ceiling['seconds'])} ms per step (GEMMs {_ms(ceiling['gemm_s'])} + attention "
            f"{_ms(ceiling['attention_s'])}{bubble}), {ceiling['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU, "
            f"MFU {ceiling['mfu_pct']:.1f}%")


def _ms(seconds: float) -> str:
    """Milliseconds with a decimal, or three significant digits below 10 ms."""
    ms = 1e3 * seconds
    return f"{ms:,.1f}" if ms >= 10 else f"{ms:.3g}"


def run(shape: str, steps: int, warmup: int, extra: list[str], profile_dir: Path | None = None) -> dict | None:
    import torch

    from dtrain.config import load_config
    from dtrain.plan import advice, steptime
    from dtrain.plan.validate import with_global_batch
    from dtrain.train import train

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    argv = [*SHAPES[shape], "--data", "synthetic", "--steps", str(steps), "--warmup-steps", "2", "--lr", "3e-4",
            "--run-dir", f"runs/bench-{shape}"]
    config = with_global_batch(load_config(argv + extra), world_size)

    @functools.cache
    def ceiling() -> dict:
        """Asked once the run has checked the configuration, with the layout --mesh auto took."""
        resolved = advice.choose(config, world_size) if config.parallel.mesh == "auto" else config
        return steptime.ceiling(with_global_batch(resolved, world_size), world_size).as_dict()

    profiler = Profiler(profile_dir, warmup, ceiling)
    history = train(config, before_step=profiler)
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
    }
    print(json.dumps(result), flush=True)
    return result


def _options(row: dict, leave_out: tuple[str, ...] = ("--mesh", "--run-dir")) -> list[str]:
    from dtrain.plan.measured import run_options

    return run_options(row, leave_out)


def _newest(path: Path, keep=lambda row: True) -> list[dict]:
    """The newest row of each setup among those `keep` takes, in the README's order."""
    newest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if keep(r):
                newest[(r["shape"], r["gpus"], r["mesh"], r["micro_batch"], r["global_batch"], *_options(r))] = r
    order = {shape: i for i, shape in enumerate(SHAPES)}
    return sorted(newest.values(), key=lambda r: (order.get(r["shape"], len(order)), r["gpus"], r["seq_len"],
                                                  r["mesh"], r["global_batch"], _options(r)))


def table(path: Path) -> str:
    """The README table from JSON lines written by this tool: the newest run of each setup."""
    rows = _newest(path)
    lines = ["| shape | GPUs | mesh | seq | micro/global batch | precision | options | tok/s/GPU | MFU | peak mem/GPU | date, commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        options = " ".join(_options(r)) or "-"
        mfu = f"{r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None else "-"
        if _masked(r) and r.get("mfu_document_attention_pct") is not None:
            # The convention counts a masked run's attention as dense; what it attends says more.
            mfu += f" ({r['mfu_document_attention_pct']:.1f}% attended)"
        lines.append(
            f"| {r['shape']} | {r['gpus']}x {r['device'].replace('NVIDIA ', '')} | {r['mesh']} | {r['seq_len']} | "
            f"{r['micro_batch']}/{r['global_batch']} | {r['precision']} | {options} | "
            f"{r['tokens_per_sec_per_gpu']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} GB | {r['date']}, {r['commit']} |"
        )
    return "\n".join(lines)


def breakdowns(path: Path) -> str:
    """Where the steps of the newest profiled run of each setup went (rank 0, ms per step and
    share of the profiled step), beside the ceiling of the setup."""
    from tools.profile_breakdown import CATEGORIES

    rows = _newest(path, keep=lambda r: r.get("profile") is not None)
    if not rows:
        return "(no profiled runs: `python -m tools.bench --profile DIR` makes one)"

    def cell(ms: float, r: dict) -> str:
        return f"{ms:,.1f} ({100 * ms / r['profile']['step_ms']:.1f}%)"

    def ceiling_of(r: dict, key: str) -> str:
        return _ms(r["ceiling"][key]) if r.get("ceiling") else "-"

    columns = [f"{r['shape']}, {r['gpus']}x {r['device'].replace('NVIDIA ', '')}, {r['mesh']}, "
               f"{' '.join(_options(r)) or '-'}" for r in rows]
    lines = ["| ms per step (share of the profiled step) | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(rows)]

    def add(label: str, cells) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for category, label in CATEGORIES.items():
        cells = [cell(r["profile"]["ms"][category], r) for r in rows]
        if category in ("gemm", "attention"):
            cells = [f"{c}; ceiling {ceiling_of(r, f'{category}_s')}" for c, r in zip(cells, rows)]
        elif category == "communication":
            label = "communication with no other kernel beside it (all of it)"
            cells = [f"{c} ({r['profile']['busy_ms'][category]:,.1f})" for c, r in zip(cells, rows)]
        add(label, cells)
    add("idle (no kernel running)", [cell(r["profile"]["idle_ms"], r) for r in rows])
    add("profiled step", [f"{r['profile']['step_ms']:,.1f}" for r in rows])
    add("median step, MFU", [f"{1e3 * r['median_step_s']:,.1f}, {r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None
                             else f"{1e3 * r['median_step_s']:,.1f}" for r in rows])
    add("ceiling: step, MFU", [f"{ceiling_of(r, 'seconds')}, {r['ceiling']['mfu_pct']:.1f}%" if r.get("ceiling")
                               else "-" for r in rows])
    add("date, commit", [f"{r['date']}, {r['commit']}" for r in rows])
    return "\n".join(lines)


def _write_companions(readme: Path, results: Path) -> None:
    """The tables rendered from the same results (and the FP8 curves file beside them), each where
    the README has its markers."""
    from tools import fp8_tables

    companions = {"breakdown": lambda: breakdowns(results), "fp8 recipes": lambda: fp8_tables.recipes_table(results),
                  "fp8 curves": lambda: fp8_tables.curves_table(results.parent / fp8_tables.CURVES_FILE)}
    for kind, render in companions.items():
        if README_MARKERS[kind][0] in readme.read_text():
            write_into_readme(readme, kind, render())


def _masked(row: dict) -> bool:
    """Whether the run attends within documents or a sliding window rather than whole causal rows."""
    return "--document-mask" in row["args"] or any("sliding_window" in arg for arg in row["args"])


def _flag_value(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def bubbles(path: Path) -> str:
    """The measured and ideal pipeline bubble of every pair of runs that differ only in the
    number of micro-batches per step (m and 2m)."""
    from parallel import pipeline
    from parallel.mesh import MeshSpec

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    runs = {}
    for r in rows:
        spec = MeshSpec.parse(r["mesh"] if r["mesh"] != "single" else "", r["gpus"])
        if spec.pp == 1:
            continue
        args = _options(r, leave_out=("--mesh", "--run-dir", "--global-batch"))
        m = r["global_batch"] // (r["micro_batch"] * spec.dp_size)
        runs[(r["shape"], r["mesh"], r["micro_batch"], " ".join(args), m)] = (r, spec)
    lines = ["| shape | mesh | schedule | stages/rank | micro-batches m | step time (m) | step time (2m) | "
             "measured bubble | ideal bubble |", "|---|---|---|---|---|---|---|---|---|"]
    for (shape, mesh, _, args, m), (r, spec) in sorted(runs.items()):
        double = runs.get((shape, mesh, r["micro_batch"], args, 2 * m))
        if double is None:
            continue
        t_m, t_2m = r["median_step_s"], double[0]["median_step_s"]
        per_micro_batch = (t_2m - t_m) / m
        measured = 1 - m * per_micro_batch / t_m
        schedule = _flag_value(r["args"], "--pp-schedule", "1f1b")
        v = int(_flag_value(r["args"], "--pp-virtual-stages", "1"))
        ideal = pipeline.ideal_bubble(spec.pp, v, m)
        lines.append(f"| {shape} | {mesh} | {schedule} | {v} | {m} | {t_m:.3f} s | {t_2m:.3f} s | "
                     f"{100 * measured:.1f}% | {100 * ideal:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help=f"profile {PROFILED_STEPS} steps after warm-up; write where each rank's time went "
                        "and its top kernels to DIR (profile_rank<r>.txt and .json), and rank 0's breakdown "
                        "into the JSON line")
    parser.add_argument("--table", type=Path, help="print the markdown table of a JSON-lines file and exit")
    parser.add_argument("--bubble", type=Path, metavar="FILE",
                        help="print the measured pipeline bubbles of the runs in a JSON-lines file and exit")
    parser.add_argument("--readme", type=Path, help="with --table or --bubble: also write the table into this "
                        "file, between its markers (see README_MARKERS)")
    parser.add_argument("--attention", metavar="SETUP", help="time attention sub-blocks alone, forward + backward: "
                        "one of the setups of tools/bench_attention.py, or all; then exit")
    parser.add_argument("--attention-batch", type=int, default=4)
    parser.add_argument("--attention-seq-len", type=int, default=4096)
    parser.add_argument("--compile", action="store_true", help="with --attention: compile each sub-block")
    args = parser.parse_args(argv)
    if args.attention:
        from tools import bench_attention

        names = list(bench_attention.SETUPS) if args.attention == "all" else [args.attention]
        unknown = [name for name in names if name not in bench_attention.SETUPS]
        if unknown:
            parser.error(f"--attention {unknown[0]}: choose one of {', '.join(bench_attention.SETUPS)} or all")
        bench_attention.run(names, args.attention_batch, args.attention_seq_len, args.steps, args.compile)
        return 0
    for kind, source, render in (("table", args.table, table), ("bubble", args.bubble, bubbles)):
        if source:
            rendered = render(source)
            if args.readme:
                write_into_readme(args.readme, kind, rendered)
                if kind == "table":
                    _write_companions(args.readme, source)
            print(rendered)
            return 0
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.profile is not None:
        try:  # before the run, rather than losing its profile at the end
            args.profile.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--profile {args.profile}: {error.strerror}; give a directory this process can write")
    run(args.shape, args.steps, args.warmup, extra, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
