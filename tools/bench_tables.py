"""The benchmark tables of README.md and docs/, rendered from the JSON lines `tools.bench` writes
(`python -m tools.docs --refresh` writes every one between its markers in every page; `python -m
tools.bench --table benchmarks/results.jsonl [--readme PAGE]` one page's): the headline rows beside
the plain PyTorch baseline of the same call (tools/bench_page.py), the newest run of each setup,
the step breakdowns of profiled runs beside their ceilings, the FP8 recipes side by side and their
loss curves (tools/fp8_tables.py), attention sub-blocks and routed experts alone
(benchmarks/attention.jsonl, experts.jsonl), and pipeline bubbles measured from pairs of runs
(`--bubble`). A results file that is missing or holds a broken line is a one-line error
(`dtrain.planner.measured.read_rows`)."""

from __future__ import annotations

from pathlib import Path

from dtrain.metrics import peak_flops_of
from dtrain.planner.measured import gpu_name, masked_run, read_rows, run_options, setup_key
from tools import fp8_tables
from tools.shapes import SHAPES

# Where each rendering goes in a page: between its begin and end markers.
_REFRESH = "python -m tools.docs --refresh"
README_MARKERS = {
    "table": (f"<!-- benchmark table: {_REFRESH} -->", "<!-- end of benchmark table -->"),
    "bubble": (f"<!-- bubble table: {_REFRESH} -->", "<!-- end of bubble table -->"),
    # Written with the table, where the page has these markers.
    **{kind: (f"<!-- {title}: {_REFRESH} -->", f"<!-- end of {title} -->")
       for kind, title in (("breakdown", "step breakdown"), ("fp8 recipes", "fp8 recipes"), ("fp8 curves", "fp8 curves"),
                           ("attention", "attention table"), ("experts", "experts table"),
                           ("headline", "headline table"))},
}
# The attention sub-blocks' rows (tools/bench_attention.py) and the experts' (tools/bench_experts.py),
# beside the results file.
ATTENTION_FILE = "attention.jsonl"
EXPERTS_FILE = "experts.jsonl"


def write_into_readme(readme: Path, kind: str, rendered: str) -> None:
    begin, end = README_MARKERS[kind]
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"error: {readme} lacks the markers {begin!r} and {end!r}; add them where the "
                         f"{kind} goes")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{begin}\n{rendered}\n{end}{tail}")


def ms_text(seconds: float) -> str:
    """Milliseconds with a decimal, or three significant digits below 10 ms."""
    ms = 1e3 * seconds
    return f"{ms:,.1f}" if ms >= 10 else f"{ms:.3g}"


def _newest(path: Path, keep=lambda row: True) -> list[dict]:
    """The newest row of each setup among those `keep` takes, in the README's order."""
    newest: dict[tuple, dict] = {}
    for r in filter(keep, read_rows(path)):
        newest[setup_key(r)] = r
    order = {shape: i for i, shape in enumerate(SHAPES)}
    return sorted(newest.values(), key=lambda r: (order.get(r["shape"], len(order)), r["gpus"], r["seq_len"],
                                                  r["mesh"], r["global_batch"], run_options(r)))


def table(path: Path) -> str:
    """The README table from JSON lines written by this tool: the newest run of each setup."""
    rows = _newest(path)
    lines = ["| shape | GPUs | mesh | seq | micro/global batch | precision | options | tok/s/GPU | MFU | peak mem/GPU | date, commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        options = " ".join(run_options(r)) or "-"
        mfu = f"{r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None else "-"
        if masked_run(r) and r.get("mfu_document_attention_pct") is not None:
            # The convention counts a masked run's attention as dense; what it attends says more.
            mfu += f" ({r['mfu_document_attention_pct']:.1f}% attended)"
        lines.append(
            f"| {r['shape']} | {r['gpus']}x {gpu_name(r['device'])} | {r['mesh']} | {r['seq_len']} | "
            f"{r['micro_batch']}/{r['global_batch']} | {r['precision']} | {options} | "
            f"{r['tokens_per_sec_per_gpu']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} GB | {r['date']}, {r['commit']} |"
        )
    return "\n".join(lines)


def breakdowns(path: Path) -> str:
    """Where the steps of the newest profiled run of each setup went (rank 0, ms per step and
    share of the profiled step), beside the ceiling of the setup."""
    from dtrain.diagnose.breakdown import CATEGORIES

    rows = _newest(path, keep=lambda r: r.get("profile") is not None)
    if not rows:
        return "(no profiled runs: `python -m tools.bench --profile DIR` makes one)"

    def cell(ms: float, r: dict) -> str:
        return f"{ms:,.1f} ({100 * ms / r['profile']['step_ms']:.1f}%)"

    def ceiling_of(r: dict, key: str) -> str:
        return ms_text(r["ceiling"][key]) if r.get("ceiling") else "-"

    columns = [f"{r['shape']}, {r['gpus']}x {gpu_name(r['device'])}, {r['mesh']}, "
               f"{' '.join(run_options(r)) or '-'}" for r in rows]
    lines = ["| ms per step (share of the profiled step) | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(rows)]

    def add(label: str, cells) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for category, label in CATEGORIES.items():
        # "-" where a row was profiled before the category existed (its kernels counted elsewhere).
        cells = [cell(r["profile"]["ms"][category], r) if category in r["profile"]["ms"] else "-" for r in rows]
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


def attention_table(path: Path) -> str:
    """The newest row of each attention setup at each batch, sequence and compile setting:
    milliseconds per forward + backward, and model TFLOP/s as a share of the dense BF16 peak."""
    if not path.exists():
        return f"(no attention runs: `python -m tools.bench --attention all --compile > {path}` makes them)"
    newest = {(r["setup"], r["batch"], r["seq_len"], r["compile"]): r for r in read_rows(path)}
    lines = ["| setup | heads | batch x seq | compiled | ms fwd+bwd | tokens/s | model TFLOP/s | share of peak | "
             "MLA's values | device, date, commit |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(newest.values(), key=lambda r: (not r["compile"], r["seq_len"], r["batch"], r["setup"])):
        peak = peak_flops_of(r["device"])
        share = f"{100 * r['model_tflops'] * 1e12 / peak:.1f}%" if peak else "-"
        lines.append(f"| {r['setup']} | {r['heads']} | {r['batch']} x {r['seq_len']} | {'yes' if r['compile'] else 'no'} | "
                     f"{r['ms_fwd_bwd']:.2f} | {r['tokens_per_sec']:,} | {r['model_tflops']:.0f} | {share} | "
                     f"{r['value_path'] or '-'} | "
                     f"{gpu_name(r['device'])}, {r['date']}, {r['commit']} |")
    return "\n".join(lines)


def experts_table(path: Path) -> str:
    """The newest row of each way of running each shape's experts: milliseconds per SwiGLU
    forward + backward at the same rows."""
    if not path.exists():
        return f"(no experts runs: `python -m tools.bench_experts` writes {path})"
    # Rows of a way that failed (a recipe or package the machine lacks) have no time to show.
    newest = {(r["shape"], r["rows"], r["way"]): r for r in read_rows(path) if "ms" in r}
    lines = ["| shape | experts x FFN | rows | way | ms fwd+bwd | TFLOP/s | device, date, commit |",
             "|---|---|---|---|---|---|---|"]
    shapes = list(dict.fromkeys(shape for shape, _, _ in newest))  # each shape's rows together, in file order
    for r in sorted(newest.values(), key=lambda r: shapes.index(r["shape"])):
        lines.append(f"| {r['shape']} | {r['experts']} x {r['expert_ffn_dim']} | {r['rows']:,} | {r['way']} | "
                     f"{r['ms']:.2f} | {r['tflops']:.0f} | {gpu_name(r['device'])}, {r['date']}, "
                     f"{r['commit']} |")
    return "\n".join(lines)


def render(kind: str, results: Path) -> str:
    """The table of marker kind `kind` from `results` (and the files beside it)."""
    from tools import bench_page

    renderers = {"table": table, "bubble": bubbles, "breakdown": breakdowns, "fp8 recipes": fp8_tables.recipes_table,
                 "fp8 curves": lambda r: fp8_tables.curves_table(r.parent / fp8_tables.CURVES_FILE),
                 "attention": lambda r: attention_table(r.parent / ATTENTION_FILE),
                 "experts": lambda r: experts_table(r.parent / EXPERTS_FILE), "headline": bench_page.headline}
    return renderers[kind](results)


def companion_tables(readme: Path, results: Path) -> dict[str, str]:
    """The tables rendered from the same results (and the FP8 curves, attention and experts files
    beside them) that the page has markers for, by marker kind."""
    text = readme.read_text()
    return {kind: render(kind, results) for kind in ("breakdown", "fp8 recipes", "fp8 curves", "attention", "experts",
                                                     "headline")
            if README_MARKERS[kind][0] in text}


def bubbles(path: Path) -> str:
    """The measured and ideal pipeline bubble of every pair of runs that differ only in the
    number of micro-batches per step (m and 2m)."""
    from dtrain.planner.measured import row_layout
    from parallel import pipeline

    rows = read_rows(path)
    runs = {}
    for r in rows:
        if "pp=" not in r["mesh"]:
            continue
        layout = row_layout([*SHAPES[r["shape"]], "--micro-batch", str(r["micro_batch"]), "--global-batch",
                             str(r["global_batch"]), *r["args"]], r["gpus"])
        if layout.mesh.pp == 1:
            continue
        args = run_options(r, leave_out=("--mesh", "--run-dir", "--global-batch"))
        m = layout.num_microbatches
        runs[(r["shape"], r["mesh"], r["micro_batch"], " ".join(args), m)] = (r, layout)
    lines = ["| shape | mesh | schedule | stages/rank | micro-batches m | step time (m) | step time (2m) | "
             "measured bubble | ideal bubble |", "|---|---|---|---|---|---|---|---|---|"]
    for (shape, mesh, _, args, m), (r, layout) in sorted(runs.items()):
        double = runs.get((shape, mesh, r["micro_batch"], args, 2 * m))
        if double is None:
            continue
        t_m, t_2m = r["median_step_s"], double[0]["median_step_s"]
        per_micro_batch = (t_2m - t_m) / m
        measured = 1 - m * per_micro_batch / t_m
        schedule, v = layout.pipeline.schedule, layout.pipeline.virtual_stages
        ideal = pipeline.ideal_bubble(layout.mesh.pp, v, m)
        lines.append(f"| {shape} | {mesh} | {schedule} | {v} | {m} | {t_m:.3f} s | {t_2m:.3f} s | "
                     f"{100 * measured:.1f}% | {100 * ideal:.1f}% |")
    return "\n".join(lines)
