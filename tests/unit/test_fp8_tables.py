"""The README's FP8 tables come from recorded runs: the recipes side by side from the benchmark
results, the loss curves from the file `tools.te_check` records them in."""

from __future__ import annotations

import json
import random

import pytest

from tools import bench, bench_tables, fp8_tables


BASE = ["--compile"]
PRECISIONS = {"bf16": [], "torchao": ["--fp8", "tensorwise"], "te": ["--fp8-backend", "te", "--fp8", "delayed"]}


def _row(precision: str, speed: float, date: str, commit: str, *extra: str, mesh: str = "single") -> dict:
    # One tools.bench_suite call per date and commit here, unless a test says otherwise.
    return {"shape": "llama-1b", "gpus": 1, "mesh": mesh, "seq_len": 4096, "micro_batch": 4, "global_batch": 4,
            "precision": "bf16", "tokens_per_sec_per_gpu": speed, "mfu_pct": speed / 1000, "peak_mem_gb": 40.0,
            "device": "NVIDIA H200", "date": date, "commit": commit, "args": [*BASE, *PRECISIONS[precision], *extra],
            "call": f"{date}-{commit}"}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_te_is_compared_with_torchao_of_its_own_session_and_setups_without_te_are_left_out(tmp_path):
    rows = [_row("bf16", 50_000, "2026-12-01", "aaa"),
            _row("torchao", 60_000, "2026-12-01", "aaa"),
            _row("te", 63_000, "2026-12-01", "aaa"),
            _row("torchao", 66_000, "2026-12-02", "bbb"),  # newer torchao, no TE beside it
            _row("te", 70_000, "2026-12-02", "ccc", "--fp8-head"),
            _row("torchao", 64_000, "2026-12-02", "ccc", "--fp8-head"),
            _row("torchao", 99_000, "2026-12-02", "ccc", mesh="dp=2"),  # a setup never run with TE
            {**_row("te", 5_000, "2026-12-02", "ddd", "--fp8-experts"), "mfu_pct": None}]
    results = tmp_path / "results.jsonl"
    _write(results, rows)
    table = fp8_tables.recipes_table(results).splitlines()
    assert table[0] == "| setup | in FP8 | bf16 | torchao tensorwise | te delayed |"
    blocks, head = table[2], table[3]
    assert "| blocks |" in blocks and "| blocks, head |" in head and len(table) == 5
    assert "| blocks, experts | 50,000 (50.0%), aaa |  | 5,000, ddd |" in table[4]  # no MFU known
    # The newest run of each recipe; TE's ratio against torchao of the same call (63/60), not
    # against the newer torchao run (63/66).
    assert "66,000 (66.0%), bbb" in blocks and "63,000 (63.0%), 1.050x, aaa" in blocks
    assert "70,000 (70.0%), 1.094x, ccc" in head and "50,000 (50.0%), aaa" in head
    assert "99,000" not in "\n".join(table)
    # Runs of the same day and commit in two calls (or recorded before calls were) show no ratio.
    for te_call, torchao_call in (("one", "two"), (None, None)):
        _write(results, [{**_row("torchao", 60_000, "2026-12-01", "aaa"), "call": torchao_call},
                         {**_row("te", 63_000, "2026-12-01", "aaa"), "call": te_call}])
        assert "| 63,000 (63.0%), aaa |" in fp8_tables.recipes_table(results)


def test_the_curve_report_compares_window_means_with_the_first_curve():
    rng = random.Random(0)
    steps = range(1, 61)
    bf16 = {s: 10.0 / s ** 0.5 + 0.01 * rng.gauss(0, 1) for s in steps}
    higher = {s: loss * 1.02 for s, loss in bf16.items()}
    report = fp8_tables.curve_report({"bf16": bf16, "fp8": higher})
    assert "| 1-1 | " in report and "| 41-50 | " in report and "| 51-60 | " in report
    assert f"| 51-60 | {sum(bf16[s] for s in range(51, 61)) / 10:.4f} | +2.00% |" in report
    assert "| steps 41-60 | | +2.00% |" in report and "steps 11-60 | | 2.00% |" in report
    assert "against the mean" not in report
    # A repeated reference run: every curve against the references' mean too.
    report = fp8_tables.curve_report({"bf16": bf16, "bf16 again": {s: v * 1.04 for s, v in bf16.items()},
                                      "fp8": higher})
    assert "| steps 41-60 against the mean of bf16 and bf16 again | -1.96% | +1.96% | +0.00% |" in report
    with pytest.raises(ValueError, match="share 5 steps"):
        fp8_tables.curve_report({"bf16": {s: 1.0 for s in range(5)}, "fp8": {s: 1.0 for s in range(5)}})


def test_curves_recorded_as_they_finish_render_in_run_order_into_the_readme(tmp_path):
    rng = random.Random(1)
    steps = range(1, 31)
    bf16 = {s: 8.0 / s ** 0.5 + 0.01 * rng.gauss(0, 1) for s in steps}
    about = {"curves": ["bf16", "te delayed"], "args": ["--model", "llama-1b"], "commit": "abc", "date": "2026-12-02"}
    curves = tmp_path / fp8_tables.CURVES_FILE
    fp8_tables.record_curves(curves, "te delayed", {s: v * 0.99 for s, v in bf16.items()}, about)  # finished first
    fp8_tables.record_curves(curves, "bf16", bf16, about)
    results = tmp_path / "results.jsonl"
    _write(results, [_row("te", 63_000, "2026-12-01", "aaa")])
    markers = {kind: bench_tables.README_MARKERS[kind] for kind in ("table", "fp8 recipes", "fp8 curves")}
    readme = tmp_path / "README.md"
    readme.write_text("".join(f"{begin}\nstale\n{end}\n" for begin, end in markers.values()))
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and "63,000 (63.0%), aaa" in text
    assert "| steps | bf16 | te delayed |" in text and "| steps 11-30 | | -1.00% |" in text
    assert "`--model llama-1b`; 2026-12-02, abc." in text
    # Without a curves file the section says how to make one.
    curves.unlink()
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    assert "python -m tools.te_check --phase curves" in readme.read_text()
