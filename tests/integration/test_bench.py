"""The benchmark tool: a CPU run prints one JSON line; the README table and pipeline bubbles are
computed from such lines."""

from __future__ import annotations

import json

from tests.launch import REPO, run_cli
from tools import bench, bench_tables


def test_cpu_run_prints_one_json_line_with_its_profile_and_ceiling(tmp_path):
    from dtrain.planner import steptime
    from tests.layouts import resolved
    from dtrain.diagnose.breakdown import CATEGORIES

    args = ["--run-dir", str(tmp_path / "run"), "--precision", "fp32", "--seq-len", "64", "--micro-batch", "2"]
    result = run_cli(["--shape", "tiny", "--steps", "4", "--warmup", "1", "--profile", str(tmp_path / "profile"),
                      "--", *args], module="tools.bench")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["shape"] == "tiny" and row["tokens_per_sec_per_gpu"] > 0 and row["steps"] == 4
    assert row["ceiling"] == steptime.ceiling(resolved([*bench.SHAPES["tiny"], *args])).as_dict()
    # Three steps profiled after the warm-up step; on a CPU run the ops are the work.
    profile = row["profile"]
    assert profile["steps"] == 3 and set(profile["ms"]) == set(CATEGORIES)
    for category in ("gemm", "attention", "loss", "elementwise", "optimizer"):
        assert profile["ms"][category] > 0, (category, profile)
    # Exclusive times and idle add up to the profiled step (each rounded to a microsecond).
    assert abs(sum(profile["ms"].values()) + profile["idle_ms"] - profile["step_ms"]) < 0.01
    text = (tmp_path / "profile" / "profile_rank0.txt").read_text()
    assert "3 profiled steps" in text and "ceiling, GEMMs and attention alone" in text and "aten::mm" in text
    assert json.loads((tmp_path / "profile" / "profile_rank0.json").read_text())["ms"] == profile["ms"]
    path = tmp_path / "results.jsonl"
    path.write_text(lines[0] + "\n")
    assert f"{row['tokens_per_sec_per_gpu']:,.0f}" in bench_tables.table(path)
    assert f"{profile['step_ms']:,.1f}" in bench_tables.breakdowns(path)


def test_suite_runs_the_cpu_setup_and_appends_its_json_line(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text('{"earlier": "run"}\n')
    result = run_cli(["--gpus", "0", "--only", "cpu tiny", "--out", str(out), "--runs-dir", str(tmp_path / "runs")],
                     module="tools.bench_suite")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # The setup's run directory is where it was told, not in the repository's runs/.
    assert (tmp_path / "runs" / "suite-cpu-tiny" / "train.log").is_file()
    lines = out.read_text().splitlines()
    assert [json.loads(line)["shape"] for line in lines[1:]] == ["tiny", "tiny-qwen3", "tiny-gpt-oss", "tiny-llama4"]
    assert "cpu tiny" in result.stdout and "tok/s/GPU" in result.stdout


def test_a_loss_check_runs_in_the_baseline_checkout_too_and_is_compared(tmp_path):
    """The checkout itself as the baseline: the same code, the same losses on CPU; the check's
    second run beside its first; every row appended, the baseline's under its commit."""
    out = tmp_path / "results.jsonl"
    out.touch()
    result = run_cli(["--gpus", "0", "--only", "cpu moe", "--out", str(out), "--baseline", str(REPO),
                      "--baseline-commit", "same-code", "--runs-dir", str(tmp_path / "runs")],
                     module="tools.bench_suite")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["commit"] == "same-code" for r in rows] == [False, True, False]
    lines = [line for line in result.stdout.splitlines() if line.startswith("cpu moe loss check")]
    assert len(lines) == 3 and "(baseline same-code)" in lines[1]
    for line, label in zip(lines[1:], ("the baseline's", "the first run")):
        assert f"losses against {label} over 3 steps: largest relative difference 0.00e+00" in line, line
    bad = run_cli(["--gpus", "0", "--only", "cpu moe", "--out", str(out), "--baseline", str(tmp_path)],
                  module="tools.bench_suite")
    assert bad.returncode == 2 and "not a dtrain checkout" in bad.stderr


def test_every_attention_setup_runs_forward_and_backward_on_cpu(tmp_path):
    """The attention benchmark's code path for each setup (its parameters, RoPE, MLA or GQA, the
    backward) on SDPA's math kernel: what a GPU call would otherwise be the first to run. Its rows
    render into the README's attention table, the newest of each setup."""
    import torch

    from tools import bench_attention

    rows = []
    for name in bench_attention.SETUPS:
        row = bench_attention.run_setup(name, batch=1, seq_len=32, iterations=1, compile_=False,
                                        device=torch.device("cpu"))
        assert row["setup"] == name and row["device"] == "cpu" and row["ms_fwd_bwd"] > 0 and row["commit"]
        assert row["tokens_per_sec"] > 0  # (its TFLOP/s, rounded to 0.1, can be 0.0 on a CPU)
        assert row["value_path"] == (None if name.startswith("gqa") else "math kernel (CPU)"), name
        rows.append(row)
    results, readme = tmp_path / "results.jsonl", tmp_path / "README.md"
    results.write_text("")
    readme.write_text("".join(f"{begin}\n{end}\n" for kind, (begin, end) in bench_tables.README_MARKERS.items()
                              if kind in ("table", "attention")))
    assert bench_tables.companion_tables(readme, results)["attention"].startswith("(no attention runs")
    stale = {**rows[0], "ms_fwd_bwd": 123456.0}
    (tmp_path / bench_tables.ATTENTION_FILE).write_text("".join(json.dumps(r) + "\n" for r in [stale, *rows]))
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert all(f"| {name} |" in text for name in bench_attention.SETUPS) and "123456" not in text
    assert text.count("| cpu, ") == len(bench_attention.SETUPS)
