"""The benchmark tool: a CPU run prints one JSON line; the README table and pipeline bubbles are
computed from such lines."""

from __future__ import annotations

import json

from tests.launch import run_cli
from tools import bench


def test_cpu_run_prints_one_json_line(tmp_path):
    result = run_cli(["--shape", "tiny", "--steps", "3", "--warmup", "1", "--",
                      "--run-dir", str(tmp_path / "run"), "--precision", "fp32"], module="tools.bench")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["shape"] == "tiny" and row["tokens_per_sec_per_gpu"] > 0 and row["steps"] == 3
    path = tmp_path / "results.jsonl"
    path.write_text(lines[0] + "\n")
    assert f"{row['tokens_per_sec_per_gpu']:,.0f}" in bench.table(path)


def _pipelined_run(micro_batches: int, step_s: float, schedule: str) -> dict:
    args = ["--compile", "--mesh", "pp=2", "--pp-schedule", schedule, "--micro-batch", "1",
            "--global-batch", str(micro_batches)]
    return {"shape": "llama-1b", "mesh": "pp=2", "gpus": 2, "micro_batch": 1, "global_batch": micro_batches,
            "median_step_s": step_s, "args": args}


def test_bubble_from_runs_at_m_and_2m_micro_batches(tmp_path):
    # Step time = (m + p - 1) * t + fixed: the measured bubble must be everything but m * t.
    t, fixed, p, m = 0.04, 0.013, 2, 8
    def step_time(micro_batches):
        return (micro_batches + p - 1) * t + fixed
    rows = [_pipelined_run(m, step_time(m), "1f1b"), _pipelined_run(2 * m, step_time(2 * m), "1f1b"),
            _pipelined_run(m, 0.5, "gpipe")]  # no 2m partner: left out
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    lines = bench.bubbles(path).splitlines()
    assert len(lines) == 3
    expected = 1 - m * t / step_time(m)
    ideal = (p - 1) / (m + p - 1)
    assert f"| {100 * expected:.1f}% | {100 * ideal:.1f}% |" in lines[2]


def test_compare_runs_reports_the_largest_relative_difference():
    from tools.compare_runs import compare

    a = {"train/loss": {1: 4.0, 2: 3.0, 3: 2.0}}
    b = {"train/loss": {1: 4.0, 2: 3.3, 3: 2.1, 4: 9.0}}  # step 4 is not in both runs
    result = compare(a, b, ["train/loss"])["train/loss"]
    assert result["steps"] == 3 and result["at_step"] == 2
    assert abs(result["max_rel_diff"] - abs(3.3 - 3.0) / 3.0) < 1e-12


def test_readme_gets_the_newest_run_of_each_setup_between_its_markers(tmp_path):
    old = {**_pipelined_run(8, 0.5, "1f1b"), "tokens_per_sec_per_gpu": 1000.0, "mfu_pct": 10.0, "seq_len": 4096,
           "precision": "bf16", "peak_mem_gb": 20.0, "device": "NVIDIA H200", "date": "2026-11-01", "commit": "aaa"}
    # The same flags in another order: the same setup.
    args = old["args"]
    new = {**old, "tokens_per_sec_per_gpu": 2000.0, "commit": "bbb", "args": args[-2:] + args[:-2]}
    assert new["args"] != old["args"]
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")
    begin, end = bench.README_MARKERS["table"]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{begin}\nstale\n{end}\noutro\n")
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale" not in text
    assert "2,000" in text and "1,000" not in text  # the same setup: only the newer run


def test_suite_runs_the_cpu_setup_and_appends_its_json_line(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text('{"earlier": "run"}\n')
    result = run_cli(["--gpus", "0", "--out", str(out)], module="tools.bench_suite")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["shape"] == "tiny"
    assert "cpu tiny" in result.stdout and "tok/s/GPU" in result.stdout


def test_suite_selects_by_gpu_count_and_name():
    from tools import bench_suite

    on_one = bench_suite.selected(1, [])
    assert on_one and all(bench_suite.SUITE[name][0] == 1 and not name.startswith("cpu") for name in on_one)
    assert bench_suite.selected(0, []) == ["cpu tiny"]
    cp_runs = bench_suite.selected(2, ["cp="])
    assert cp_runs and all("cp=" in name for name in cp_runs)
    for group, members in bench_suite.GROUPS.items():
        assert bench_suite.selected(2, [], group) == [name for name in bench_suite.SUITE if name in members]
        assert set(members) <= set(bench_suite.SUITE), f"{group}: {set(members) - set(bench_suite.SUITE)}"
    assert bench_suite.selected(2, ["70b"], "tp-overlap") == [
        "llama-70b-4l dp=2", "llama-70b-4l tp=2", "llama-70b-4l tp=2 sp", "llama-70b-4l tp=2 sp unfused"]


def test_every_suite_setup_is_a_valid_command():
    """A typo in a setup would only show on the GPU machine: each one's dtrain flags must load."""
    from dtrain.config import load_config
    from tools import bench_suite
    from tools.bench import SHAPES

    from tools.bench_attention import SETUPS

    for name, (_, bench_args) in bench_suite.SUITE.items():
        if "--attention" in bench_args:
            assert bench_args[bench_args.index("--attention") + 1] in (*SETUPS, "all"), name
            continue
        shape = bench_args[bench_args.index("--shape") + 1]
        dtrain_flags = bench_args[bench_args.index("--") + 1:]
        load_config([*SHAPES[shape], *dtrain_flags])  # raises on an unknown flag or choice


def test_gpu_busy_summary_merges_overlapping_kernels_per_kind():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def kernel(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    # Compute kernels cover [0, 400), [600, 700) and [900, 1000) us, NCCL [300, 500): of 1 ms,
    # [500, 600) and [700, 900) have no kernel.
    events = [kernel("gemm", 0, 300), kernel("silu", 250, 400), kernel("add", 600, 700),
              kernel("ncclDevKernel_SendRecv", 300, 500), kernel("aten::mm", 0, 1000, DeviceType.CPU),
              kernel("copy", 900, 1000)]
    summary, exposed_pct = bench.gpu_busy_summary(events, wall_s=1e-3)
    assert "compute kernels running: 0.6 ms (60.0%)" in summary
    assert "communication kernels running: 0.2 ms (20.0%)" in summary
    assert "no kernel running: 0.3 ms (30.0%)" in summary
    # NCCL's [300, 500) has compute beside it until 400: [400, 500) is exposed.
    assert "(exposed): 0.1 ms (10.0%)" in summary and abs(exposed_pct - 10.0) < 1e-9


def test_symmetric_memory_copies_count_as_communication():
    assert bench.is_communication("Memcpy PtoP (Device -> Device)")
    assert bench.is_communication("Memcpy DtoD (Device -> Device)")
    assert bench.is_communication("ncclDevKernel_AllGather_RING_LL")
    assert not bench.is_communication("Memcpy HtoD (Pinned -> Device)")
    assert not bench.is_communication("sm90_xmma_gemm_bf16bf16_bf16f32")
