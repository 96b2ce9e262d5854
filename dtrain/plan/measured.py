"""The models against the GPU: predicted and measured peak memory and tokens/s for the rows of
benchmarks/results.jsonl that `python -m tools.bench --table` shows (the newest run of each setup).

    python -m dtrain.plan --validate benchmarks/results.jsonl [--readme README.md]

Some rows were measured on code that has changed since in ways that change what they measured;
they are listed with the reason and left out (`EXCLUDED`). The tests keep every other row within
the targets (tests/test_memory_model.py, tests/test_step_time.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from dtrain.config import Config, load_config
from parallel.mesh import MeshSpec

MEMORY_TOLERANCE = 0.10
THROUGHPUT_TOLERANCE = 0.15

# Commits at which the setup ran differently from today's code: (reason, what it affects).
EXCLUDED = {
    "a5c908e": ("before b17a54e the head and cross-entropy were not compiled: fp32 logits", "both"),
    "2d8561b": ("before b17a54e the head and cross-entropy were not compiled: fp32 logits", "both"),
    "e44d5ba": ("before b17a54e (eager head, fp32 logits) and f368a2a (all-gather CP on fused kernels)", "both"),
}
# Before 99163f8 and 3dc4650, MoE blocks went past torch.compile's recompile limit and ran half
# their blocks eagerly.
EXCLUDED_MOE = {"75c3da5": ("MoE blocks past the recompile limit ran eagerly (fixed in 99163f8, 3dc4650)", "both")}
# At these commits q/k/v and gate/up were one matmul each by default (--fuse-projections now).
FUSED_BY_DEFAULT = {"f12b8b3", "d5e057e"}
# Before 1e030f2 (--ep-dispatch auto) expert parallelism always ran the all-to-all.
ALLTOALL_BY_DEFAULT = {"75c3da5", "d6e61d5", "772c521"}
# An untrained router on synthetic tokens sends most tokens to a few experts; under ep the rank
# holding them sets the pace, which no model of the configuration can know.
UNBALANCED_EP = "untrained routing under ep: the step waits for the most loaded rank"


@attrs.frozen
class Row:
    """One measured run, the configuration it ran, and why it is left out (if it is)."""

    data: dict
    config: Config
    excluded: str | None = None        # from both comparisons
    time_excluded: str | None = None   # from the tokens/s comparison only

    @property
    def gpus(self) -> int:
        return self.data["gpus"]

    @property
    def label(self) -> str:
        options = " ".join(a for a in self.data["args"] if a not in ("--compile",))
        return f"{self.data['model']} {self.data['mesh']} seq {self.data['seq_len']} " \
               f"{self.data['micro_batch']}/{self.data['global_batch']} {options}".strip()


def _setup_key(row: dict) -> tuple:
    """The setups `tools.bench --table` groups by (its `_options`: flags sorted, mesh and run dir apart)."""
    flags: list[list[str]] = []
    for arg in row["args"]:
        if arg.startswith("--") or not flags:
            flags.append([arg])
        else:
            flags[-1].append(arg)
    options = [part for flag in sorted(flags) if flag[0] not in ("--mesh", "--run-dir") for part in flag]
    return (row["shape"], row["gpus"], row["mesh"], row["micro_batch"], row["global_batch"], *options)


def newest_rows(path: Path) -> list[Row]:
    """The newest GPU row of each setup, in file order of their setups, with its configuration."""
    newest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if row.get("device", "cpu") != "cpu":
                newest[_setup_key(row)] = row
    return [_row(data) for data in newest.values()]


def _row(data: dict) -> Row:
    argv = ["--model", data["model"], "--seq-len", str(data["seq_len"]), "--micro-batch", str(data["micro_batch"]),
            "--global-batch", str(data["global_batch"]), "--precision", data["precision"], *data["args"]]
    if data["commit"] in FUSED_BY_DEFAULT:
        argv.append("--fuse-projections")
    if "ep=" in data["mesh"] and "--ep-dispatch" not in data["args"] and data["commit"] in ALLTOALL_BY_DEFAULT:
        argv += ["--ep-dispatch", "alltoall"]
    config = load_config(argv)
    reason = EXCLUDED.get(data["commit"]) or (EXCLUDED_MOE.get(data["commit"]) if data["shape"] == "mixtral-small" else None)
    time_reason = None
    mesh = MeshSpec.parse(config.parallel.mesh if config.parallel.mesh != "single" else "", data["gpus"])
    if mesh.ep > 1 and "force_load_balance=true" not in config.model.model_overrides:
        time_reason = UNBALANCED_EP
    return Row(data, config, reason[0] if reason else None, time_reason)
