"""The models against the GPU: predicted and measured peak memory and tokens/s for the rows of
benchmarks/results.jsonl that `python -m tools.bench --table` shows (the newest run of each setup).

    python -m dtrain.planner --validate benchmarks/results.jsonl [--readme README.md]

Some rows were measured on code that has changed since in ways that change what they measured;
they are listed with the reason and left out (`EXCLUDED`). The tests keep every other row within
the targets (tests/test_memory_model.py, tests/test_step_time.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from dtrain.config import Config, load_config
from dtrain.layout import Machine, RunLayout, resolve
from models.errors import UserError

MEMORY_TOLERANCE = 0.10
THROUGHPUT_TOLERANCE = 0.15

# Commits at which the setup ran differently from today's code: (reason, what it affects).
EXCLUDED = {
    "a5c908e": ("before b17a54e the head and cross-entropy were not compiled: fp32 logits", "both"),
    "2d8561b": ("before b17a54e the head and cross-entropy were not compiled: fp32 logits", "both"),
    "e44d5ba": ("before b17a54e (eager head, fp32 logits) and f368a2a (all-gather CP on fused kernels)", "both"),
    "dfada40": ("from 690ec32 to 2a34cef a compiled block broke its graph at attention: recomputed blocks ran eagerly, "
                "the others as two graphs", "both"),
}
# Before 99163f8 and 3dc4650, MoE blocks went past torch.compile's recompile limit and ran half
# their blocks eagerly.
EXCLUDED_MOE = {"75c3da5": ("MoE blocks past the recompile limit ran eagerly (fixed in 99163f8, 3dc4650)", "both")}
# At these commits q/k/v and gate/up were one matmul each by default (--fuse-projections now).
FUSED_BY_DEFAULT = {"f12b8b3", "d5e057e"}
# Before 1e030f2 (--ep-dispatch auto) expert parallelism always ran the all-to-all.
ALLTOALL_BY_DEFAULT = {"75c3da5", "d6e61d5", "772c521"}
# Before 64a0ae9 the vocab-parallel cross-entropy under tp ran as torch's loss_parallel, outside
# the compiled head: fp32 log-probabilities.
EAGER_TP_LOSS = {"3dc4650", "772c521"}
# Setups the step-time model has no rates for (memory is still compared).
UNTIMED = (
    # One row, measured before 48e345c, when its experts (one shard each) still reduced their
    # gradients after every micro-batch, which cost DeepSeek layers on one GPU much of their speed.
    (lambda data: data["model"].startswith("deepseek") and "ep=" in data["mesh"],
     "no calibrated rates for DeepSeek's many narrow experts under ep yet"),
    (lambda data: "symm_mem" in data["args"], "no term for the fused symmetric-memory matmuls"),
    (lambda data: "--fp8-experts" in data["args"] and "te" in data["args"],
     "no term for Transformer Engine's FP8 experts' casts, padding and host reads of their row counts"),
)
# An untrained router on synthetic tokens sends most tokens to a few experts; under ep the rank
# holding them sets the pace, which no model of the configuration can know.
UNBALANCED_EP = "untrained routing under ep: the step waits for the most loaded rank"


@attrs.frozen
class Row:
    """One measured run, the layout it ran (resolved for the H200s it ran on), and why it is left
    out (if it is)."""

    data: dict
    layout: RunLayout
    excluded: str | None = None        # from both comparisons
    time_excluded: str | None = None   # from the tokens/s comparison only

    @property
    def config(self) -> Config:
        return self.layout.config

    @property
    def gpus(self) -> int:
        return self.data["gpus"]

    @property
    def label(self) -> str:
        return (f"{self.data['shape']} {self.data['mesh']} seq {self.data['seq_len']} "
                f"{self.data['micro_batch']}/{self.data['global_batch']} {' '.join(run_options(self.data))}")


def run_options(row: dict, leave_out: tuple[str, ...] = ("--mesh", "--run-dir")) -> list[str]:
    """A benchmark row's dtrain flags that change what is measured, without the flags in
    `leave_out` and their values (by default the mesh, shown apart, and where the run wrote its
    files), each flag with its value and sorted by flag: runs that gave the same flags in another
    order are one setup. `tools.bench --table` groups and shows rows by these."""
    flags: list[list[str]] = []
    for arg in row["args"]:
        if arg.startswith("--") or not flags:
            flags.append([arg])
        else:
            flags[-1].append(arg)
    return [part for flag in sorted(flags) if flag[0] not in leave_out for part in flag]


def flag_value(args: list[str], flag: str, default: str | None = None) -> str | None:
    """The value a benchmark row's dtrain arguments give `flag`, or `default`."""
    return args[args.index(flag) + 1] if flag in args else default


def gpu_name(device: str) -> str:
    """A benchmark row's device as the tables show it: "H200" for "NVIDIA H200"."""
    return device.replace("NVIDIA ", "")


def masked_run(row: dict) -> bool:
    """Whether the run attends within documents or a sliding window rather than whole causal rows."""
    return "--document-mask" in row["args"] or any("sliding_window" in arg for arg in row["args"])


def setup_key(row: dict) -> tuple:
    """What makes two benchmark rows one setup (the README table shows the newest row of each)."""
    return (row["shape"], row["gpus"], row["mesh"], row["micro_batch"], row["global_batch"], *run_options(row))


def read_rows(path: Path, what: str = "the JSON-lines file that python -m tools.bench wrote "
                                     "(benchmarks/results.jsonl)") -> list[dict]:
    """The JSON lines of a results file (`what`, for the error: by default the one that `python -m
    tools.bench` wrote); other lines are comments."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UserError(f"{path}: {error.strerror}; give {what}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{number} is not a whole JSON line ({error.msg}); mend or delete "
                                f"that line") from None
    return rows


def newest_mfu(path: Path, shape: str, mesh: str, options: list[str]) -> float:
    """The MFU (%, as the benchmark tool records it) of the newest GPU row of one setup of a results
    file: `shape` on `mesh` with exactly the dtrain flags `options` (as `run_options` lists them)."""
    rows = [row for row in read_rows(path) if row.get("device", "cpu") != "cpu" and row["shape"] == shape
            and row["mesh"] == mesh and run_options(row) == options]
    if not rows:
        raise UserError(f"{path} has no GPU row of {shape} on {mesh} with {' '.join(options) or 'no flags'}; give "
                        f"the results file that python -m tools.bench wrote (benchmarks/results.jsonl)")
    return rows[-1]["mfu_pct"]


def newest_rows(path: Path) -> list[Row]:
    """The newest GPU row of each setup, in file order of their setups, with its configuration."""
    newest = {setup_key(row): row for row in read_rows(path) if row.get("device", "cpu") != "cpu"}
    return [_row(data) for data in newest.values()]


def _row(data: dict) -> Row:
    argv = ["--model", data["model"], "--seq-len", str(data["seq_len"]), "--micro-batch", str(data["micro_batch"]),
            "--global-batch", str(data["global_batch"]), "--precision", data["precision"], *data["args"]]
    if data["commit"] in FUSED_BY_DEFAULT:
        argv.append("--fuse-projections")
    if "ep=" in data["mesh"] and "--ep-dispatch" not in data["args"] and data["commit"] in ALLTOALL_BY_DEFAULT:
        argv += ["--ep-dispatch", "alltoall"]
    layout = row_layout(argv, data["gpus"])
    reason = EXCLUDED.get(data["commit"]) or (EXCLUDED_MOE.get(data["commit"]) if data["shape"] == "mixtral-small" else None)
    if reason is None and "tp=" in data["mesh"] and data["commit"] in EAGER_TP_LOSS:
        reason = ("before 64a0ae9 the vocab-parallel loss ran outside the compiled head: fp32 log-probabilities", "both")
    time_reason = next((why for applies, why in UNTIMED if applies(data)), None)
    if time_reason is None and layout.mesh.ep > 1 and "force_load_balance=true" not in layout.config.model.model_overrides:
        time_reason = UNBALANCED_EP
    return Row(data, layout, reason[0] if reason else None, time_reason)


def row_layout(argv: list[str], gpus: int) -> RunLayout:
    """The layout of a benchmark row's flags on `gpus` H200s: the run's own decisions, its data
    (measured on another machine) read as synthetic tokens of the same shape."""
    config = load_config(argv)
    if config.parallel.mesh == "single":
        config = attrs.evolve(config, parallel=attrs.evolve(config.parallel, mesh=""))
    config = attrs.evolve(config, data=attrs.evolve(config.data, data="synthetic", tokenizer=None, data_cache_dir=None))
    return resolve(config, gpus, Machine.gpu_profile("h200"))


@attrs.frozen
class Comparison:
    row: Row
    memory_gb: float
    tokens_per_sec_per_gpu: float

    @property
    def memory_error(self) -> float:
        return self.memory_gb / self.row.data["peak_mem_gb"] - 1

    @property
    def throughput_error(self) -> float:
        return self.tokens_per_sec_per_gpu / self.row.data["tokens_per_sec_per_gpu"] - 1


def compare(path: Path) -> list[Comparison]:
    """Predictions for every newest row (excluded ones too: the table lists them apart)."""
    from dtrain.planner.memory import predict_peak
    from dtrain.planner.steptime import predict_step

    return [Comparison(row, predict_peak(row.layout)[0].total / 1e9, predict_step(row.layout).tokens_per_sec_per_gpu)
            for row in newest_rows(path)]


def validation_text(path: Path) -> str:
    """The predicted-against-measured table (markdown), the rows left out and why, and a summary."""
    comparisons = compare(path)
    lines = ["| shape | GPUs | mesh | seq | micro/global batch | options | peak memory: measured | predicted | "
             "error | tok/s/GPU: measured | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    left_out, notes = [], {}
    for c in comparisons:
        r = c.row.data
        if c.row.excluded:
            left_out.append(f"- {c.row.label} ({r['commit']}): {c.row.excluded}")
            continue
        time_error = f"{100 * c.throughput_error:+.1f}%"
        if c.row.time_excluded:
            notes.setdefault(c.row.time_excluded, "abcdefgh"[len(notes)])
            time_error = f"not compared ({notes[c.row.time_excluded]})"
        lines.append(f"| {r['shape']} | {r['gpus']} | {r['mesh']} | {r['seq_len']} | {r['micro_batch']}/{r['global_batch']} | "
                     f"{' '.join(run_options(r)) or '-'} | {r['peak_mem_gb']:.1f} GB | {c.memory_gb:.1f} GB | "
                     f"{100 * c.memory_error:+.1f}% | {r['tokens_per_sec_per_gpu']:,.0f} | "
                     f"{c.tokens_per_sec_per_gpu:,.0f} | {time_error} |")
    included = [c for c in comparisons if not c.row.excluded]
    timed = [c for c in included if not c.row.time_excluded]
    worst_memory = max(abs(c.memory_error) for c in included)
    worst_time = max(abs(c.throughput_error) for c in timed)
    lines += ["", f"Peak memory within {100 * worst_memory:.1f}% on all {len(included)} rows (target "
              f"{100 * MEMORY_TOLERANCE:.0f}%); tokens/s within {100 * worst_time:.1f}% on {len(timed)} rows (target "
              f"{100 * THROUGHPUT_TOLERANCE:.0f}%). " + " ".join(f"({letter}) {why}." for why, letter in notes.items()),
              "", "Rows left out (measured on older code):",
              *left_out]
    return "\n".join(lines)
