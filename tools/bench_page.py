"""The headline of the benchmarks, for the README and docs/benchmarks.md: at most 12 setups, the
newest row of each, beside the plain PyTorch baseline where the same `tools.bench_suite` call
timed one (a row's `baseline`), and the same rows as a chart (docs/benchmarks.png; matplotlib,
`pip install -e '.[charts]'`, draws it). Both are written by `python -m tools.docs --refresh`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from dtrain.planner.measured import gpu_name, masked_run, read_rows, run_options, setup_key

CHART = "benchmarks.png"
MAX_ROWS = 12
# The setups the headline shows where no run beside the baseline fills it: (shape, mesh, options),
# one per thing a reader weighs: one GPU, FP8 by each backend, FSDP, tp, cp, pp, experts, MLA.
HEADLINE_SETUPS = [
    ("llama-1b", "single", "--compile"),
    ("llama-1b", "single", "--compile --fp8 tensorwise --fp8-head --micro-batch 8"),
    ("llama-1b", "single", "--compile --fp8 delayed --fp8-backend te --fp8-head --micro-batch 8"),
    ("llama-8b", "dp=2", "--compile"),
    ("llama-8b", "dp=2", "--compile --fp8 tensorwise --fp8-head --fsdp-reshard-after-forward never"),
    ("llama-8b", "tp=2", "--compile --recompute selective --sequence-parallel --tp-overlap none"),
    ("llama-1b", "cp=2", "--compile --cp-comm a2a --document-mask --micro-batch 1 --seq-len 32768 "
                         "--synthetic-document-length 8192"),
    ("llama-1b", "pp=2", "--compile --global-batch 16 --micro-batch 1 --pp-schedule interleaved-1f1b "
                         "--pp-virtual-stages 2"),
    ("mixtral-small", "dp=2,ep=2", "--compile --ep-dispatch allgather --fsdp-reduce-once "
                                   "--fsdp-reshard-after-forward never --global-batch 16"),
    ("deepseek-v2-lite", "single", "--compile --global-batch 8 --micro-batch 4 "
                                   "--model-overrides num_layers=7,force_load_balance=true"),
]


def headline_rows(results: Path) -> list[dict]:
    """The newest row of each setup measured beside the baseline, then of the headline setups,
    at most MAX_ROWS."""
    newest = {setup_key(r): r for r in read_rows(results) if r.get("device", "cpu") != "cpu"}
    chosen = [r for r in newest.values() if r.get("baseline")]
    by_setup = {(r["shape"], r["mesh"], " ".join(run_options(r))): r for r in newest.values()}
    chosen += [by_setup[s] for s in HEADLINE_SETUPS if s in by_setup and not by_setup[s].get("baseline")]
    return chosen[:MAX_ROWS]


def shown_mfu(row: dict) -> float | None:
    """The MFU the headline shows: of the attention a masked run needs, where it attends within
    documents or a window (the convention counts its attention as dense)."""
    if masked_run(row) and row.get("mfu_document_attention_pct") is not None:
        return row["mfu_document_attention_pct"]
    return row["mfu_pct"]


def _options(row: dict) -> str:
    return " ".join(o for o in run_options(row) if o != "--compile")


def _baseline_cells(row: dict) -> tuple[str, str]:
    baseline = row.get("baseline")
    if not baseline:
        return "-", "-"
    plain = baseline["tokens_per_sec_per_gpu"]
    return f"{plain:,.0f}", f"{row['tokens_per_sec_per_gpu'] / plain:.2f}x"


def headline(results: Path) -> str:
    lines = ["| model | GPUs | mesh | options | tokens/s/GPU | MFU | memory/GPU | plain PyTorch, same call | "
             "dtrain / plain |", "|---|---|---|---|---|---|---|---|---|"]
    for r in headline_rows(results):
        mfu = "-" if shown_mfu(r) is None else f"{shown_mfu(r):.1f}%" + (" attended" if masked_run(r) else "")
        options = _options(r) or "-"
        lines.append(f"| {r['shape']} | {r['gpus']}x {gpu_name(r['device'])} | {r['mesh']} | {options} | "
                     f"{r['tokens_per_sec_per_gpu']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} GB | "
                     + " | ".join(_baseline_cells(r)) + " |")
    if not any(r.get("baseline") for r in headline_rows(results)):
        lines += ["", "(No row here was timed beside the plain PyTorch baseline yet; rows that were come first.)"]
    return "\n".join(lines)


def write_chart(results: Path, out: Path) -> str:
    """The headline rows' MFU as bars (the baseline's beside where measured) into `out`; what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return f"{out.name} left as it is: matplotlib is not installed (pip install -e '.[charts]')"
    rows = [r for r in headline_rows(results) if shown_mfu(r) is not None]
    labels = [f"{r['shape']}, {r['gpus']}x {gpu_name(r['device'])}, {r['mesh']}\n"
              + "\n".join(textwrap.wrap(_options(r), 44, break_on_hyphens=False)) for r in rows]
    figure, axes = pyplot.subplots(figsize=(10, 0.75 * len(rows) + 1.2))
    positions = range(len(rows))
    axes.barh([p + 0.2 for p in positions], [shown_mfu(r) for r in rows], height=0.4, label="dtrain")
    axes.barh([p - 0.2 for p in positions], [r["baseline"].get("mfu_pct", 0) if r.get("baseline") else 0 for r in rows],
              height=0.4, label="plain PyTorch, same call")
    axes.set_yticks(list(positions), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("MFU (%) of the dense BF16 peak; masked runs: of the attention they need")
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    pyplot.close(figure)
    return f"{out.name}: {len(rows)} rows"
