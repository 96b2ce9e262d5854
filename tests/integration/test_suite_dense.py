"""The one-GPU dense benchmark group on the CPU, so that a GPU call is not the first to run it:
each setup's flags load, the suite hands every process of a call one call id and the results'
folder, and the group's kinds of run (the defaults with the baseline and a profile; FP8 with the
head and a global batch) run with the GPU shapes swapped for a tiny one, their rows carrying the
baseline and the ratio."""

from __future__ import annotations

import json
import sys

from tools import bench, bench_suite, suite_dense
from tests.unit.test_suite_dense import _on_cpu


def test_the_suite_gives_one_call_id_and_the_results_folder(tmp_path, monkeypatch):
    # Each process prints the row tools.bench would, from what it was handed.
    script = ("import json, os, sys; print(json.dumps({'shape': 'tiny', 'tokens_per_sec_per_gpu': 1.0, "
              "'mfu_pct': None, 'peak_mem_gb': 0.1, 'args': sys.argv[1:], 'call': os.environ['DTRAIN_BENCH_CALL']}))")
    monkeypatch.setattr(bench_suite, "command", lambda processes, args: [sys.executable, "-c", script, *args])
    monkeypatch.delenv(bench.CALL_ENV, raising=False)
    out = tmp_path / "results.jsonl"
    names = ["llama-1b defaults", "llama-1b defaults gb32"]
    outcomes = bench_suite.run_suite(names, out, budget=float("inf"), timeout=60)
    assert all("tok/s/GPU" in outcome for _, outcome in outcomes), outcomes
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["call"] == rows[1]["call"] and rows[0]["call"]
    assert f"{tmp_path}/profiles/llama-1b-defaults" in rows[0]["args"]
    monkeypatch.setenv(bench.CALL_ENV, "given")
    bench_suite.run_suite(names[:1], out, budget=float("inf"), timeout=60)
    assert json.loads(out.read_text().splitlines()[-1])["call"] == "given"


def test_the_dense_runs_with_their_baselines_on_cpu(tmp_path, capsys):
    rows = []
    for name in ("llama-1b defaults", "llama-1b defaults fp8 head gb32"):
        args = [arg.replace("{out_dir}", str(tmp_path)) for arg in _on_cpu(suite_dense.SETUPS[name][1])]
        args += ["--run-dir", str(tmp_path / name.replace(" ", "-"))]
        assert bench.main(args) == 0
        rows.append(json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1]))
    for row in rows:
        assert row["shape"] == "tiny-defaults" and row["micro_batch"] >= 1
        assert row["baseline"]["tokens_per_sec_per_gpu"] > 0 and row["vs_baseline"] > 0
    # The memory model chose the micro-batch (no --micro-batch); the FP8 row's global batch is as
    # given, and its baseline is FP8 too, with the head.
    assert rows[0]["global_batch"] == rows[0]["micro_batch"] and rows[1]["global_batch"] == 4
    assert rows[1]["baseline"]["fp8"] == "tensorwise" and rows[1]["baseline"]["fp8_head"]
    assert rows[0]["profile"] is not None
    assert (tmp_path / "profiles" / "llama-1b-defaults" / "profile_rank0.txt").exists()
