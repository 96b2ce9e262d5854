"""The benchmark tool: a CPU run prints one JSON line; the README table and pipeline bubbles are
computed from such lines."""

from __future__ import annotations

import json

import pytest

from tools import bench, bench_tables


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
    lines = bench_tables.bubbles(path).splitlines()
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
    begin, end = bench_tables.README_MARKERS["table"]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{begin}\nstale\n{end}\noutro\n")
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "stale" not in text
    assert "2,000" in text and "1,000" not in text  # the same setup: only the newer run


def test_suite_selects_by_gpu_count_and_name():
    from tools import bench_suite

    on_one = bench_suite.selected(1, [])
    assert on_one and all(bench_suite.SUITE[name][0] == 1 and not name.startswith("cpu") for name in on_one)
    assert bench_suite.selected(0, []) == ["cpu tiny", "cpu tiny-qwen3", "cpu tiny-gpt-oss", "cpu tiny-llama4",
                                          "cpu moe loss check", "cpu moe loss check again"]
    cp_runs = bench_suite.selected(2, ["cp="])
    assert cp_runs and all("cp=" in name for name in cp_runs)
    for group, members in bench_suite.GROUPS.items():
        assert set(members) <= set(bench_suite.SUITE), f"{group}: {set(members) - set(bench_suite.SUITE)}"
        on_gpus = [name for name in members if not name.startswith("cpu")]
        assert bench_suite.selected(2, [], group) == on_gpus  # in the group's order
        assert bench_suite.selected(0, [], group) == [name for name in members if name.startswith("cpu")]
    assert bench_suite.selected(1, [], "targets") == []  # every target needs two GPUs
    assert bench_suite.selected(1, [], "families") == bench_suite.selected(2, [], "families")  # one H200
    assert bench_suite.selected(2, ["70b"], "tp-overlap") == [
        "llama-70b-4l dp=2", "llama-70b-4l tp=2", "llama-70b-4l tp=2 sp", "llama-70b-4l tp=2 sp unfused"]


def test_the_moe_group_fits_one_h200_and_its_flags_load():
    """The one-GPU MoE group, checked where no GPU is: every setup's dtrain flags load and pass
    the run's checks, and the planner puts each in the H200's memory."""
    from dtrain.layout import Machine
    from dtrain.planner.memory import predict_peak
    from tests.layouts import resolved
    from tools import bench_suite
    from tools.shapes import SHAPES

    names = bench_suite.selected(1, [], "moe-one-gpu")
    assert names[0] == "llama-1b single" and any("fp8-experts" in n for n in names)
    for name in names:
        bench_args = bench_suite.SUITE[name][1]
        if "--experts" in bench_args:
            continue
        shape = bench_args[bench_args.index("--shape") + 1]
        layout = resolved([*SHAPES[shape], *bench_args[bench_args.index("--") + 1:]], 1, Machine.gpu_profile("h200"))
        assert predict_peak(layout)[0].total < 141e9, name


def test_every_suite_setup_is_a_valid_command():
    """A typo in a setup would only show on the GPU machine: each one's dtrain flags must load."""
    from dtrain.config import load_config
    from tools import bench_suite
    from tools.shapes import SHAPES

    from tools.bench_attention import SETUPS

    for name, (_, bench_args) in bench_suite.SUITE.items():
        if "--attention" in bench_args:
            names = bench_args[bench_args.index("--attention") + 1]
            assert names == "all" or set(names.split(",")) <= set(SETUPS), name
            continue
        if "--experts" in bench_args:
            bench.build_parser().parse_args(bench_args)  # raises on an unknown flag
            continue
        shape = bench_args[bench_args.index("--shape") + 1]
        dtrain_flags = bench_args[bench_args.index("--") + 1:]
        load_config([*SHAPES[shape], *dtrain_flags])  # raises on an unknown flag or choice


def test_breakdown_counts_overlap_once_and_gives_each_instant_to_one_category():
    from dtrain.diagnose.breakdown import Activity, breakdown

    # GEMMs [0, 300), element-wise [250, 400) and [600, 700), NCCL [300, 500), a memcpy [900, 1000):
    # of 1 ms, [500, 600) and [700, 900) have no kernel.
    activities = [Activity("gemm", 0, 300, "gemm"), Activity("silu", 250, 400, "elementwise"),
                  Activity("add", 600, 700, "elementwise"), Activity("ncclDevKernel_SendRecv", 300, 500, "communication"),
                  Activity("Memcpy HtoD", 900, 1000, "other")]
    result = breakdown(activities, steps=2)
    assert result.wall_us == 1000 and result.busy_us["elementwise"] == 250 and result.busy_us["communication"] == 200
    # [250, 300) is the GEMM's; NCCL's [300, 500) has element-wise work beside it until 400.
    assert result.exclusive_us == {"gemm": 300, "attention": 0, "loss": 0, "routing": 0, "elementwise": 200,
                                   "optimizer": 0, "fsdp": 0, "other": 100, "communication": 100}
    assert result.idle_us == 300 and abs(result.exposed_communication_pct - 10.0) < 1e-9
    assert result.as_dict()["step_ms"] == 0.5 and result.as_dict()["idle_ms"] == 0.15
    assert result.top["elementwise"] == [("silu", 150, 1), ("add", 100, 1)]


def test_readme_gets_the_breakdown_of_the_newest_profiled_run_of_each_setup(tmp_path):
    from dtrain.diagnose.breakdown import CATEGORIES

    ms = {category: float(i + 1) for i, category in enumerate(CATEGORIES)}
    busy = {**ms, "communication": 20.0}
    step_ms = sum(ms.values()) + 4.0
    profiled = {**_pipelined_run(8, 0.5, "1f1b"), "tokens_per_sec_per_gpu": 1000.0, "mfu_pct": 40.0, "seq_len": 4096,
                "precision": "bf16", "peak_mem_gb": 20.0, "device": "NVIDIA H200", "date": "2026-12-01",
                "commit": "aaa", "ceiling": {"gemm_s": 0.03, "attention_s": 0.005, "bubble_s": 0.004,
                                             "seconds": 0.039, "tokens_per_sec_per_gpu": 9000.0, "mfu_pct": 61.5},
                "profile": {"steps": 3, "step_ms": step_ms, "ms": ms, "idle_ms": 4.0, "busy_ms": busy}}
    unprofiled = {**profiled, "commit": "bbb", "profile": None}  # newer, same setup
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(profiled) + "\n" + json.dumps(unprofiled) + "\n")
    readme = tmp_path / "README.md"
    table_markers, breakdown_markers = bench_tables.README_MARKERS["table"], bench_tables.README_MARKERS["breakdown"]
    readme.write_text(f"{table_markers[0]}\n{table_markers[1]}\n{breakdown_markers[0]}\nstale\n{breakdown_markers[1]}\n")
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    section = readme.read_text().partition(breakdown_markers[0])[2]
    assert "stale" not in section and "2026-12-01, aaa" in section and "bbb" not in section
    lines = section.splitlines()
    gemm = next(line for line in lines if line.startswith("| GEMMs"))
    assert f"| {ms['gemm']:.1f} ({100 * ms['gemm'] / step_ms:.1f}%); ceiling 30.0 |" in gemm
    assert "| 39.0, 61.5% |" in next(line for line in lines if line.startswith("| ceiling"))
    assert "(20.0)" in next(line for line in lines if line.startswith("| communication"))
    # A README without the breakdown's markers gets the table alone.
    readme.write_text(f"{table_markers[0]}\n{table_markers[1]}\n")
    assert bench.main(["--table", str(results), "--readme", str(readme)]) == 0
    assert "1,000" in readme.read_text()


def test_a_profile_directory_that_cannot_be_made_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    taken = tmp_path / "a-file"
    taken.write_text("")
    monkeypatch.setattr(bench, "run", lambda *args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--shape", "tiny", "--steps", "4", "--warmup", "1", "--profile", str(taken / "profile")])
    assert stopped.value.code == 2 and f"--profile {taken / 'profile'}" in capsys.readouterr().err


def test_a_gpu_shape_on_a_machine_without_gpus_is_refused_before_the_run(capsys, monkeypatch):
    monkeypatch.setattr(bench, "_has_cuda", lambda: False)
    monkeypatch.setattr(bench, "run", lambda *args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--shape", "llama-1b", "--steps", "4", "--warmup", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and "--shape llama-1b is measured on GPUs" in err and "--shape tiny" in err


@pytest.mark.parametrize("content,message", [(None, "No such file or directory; give the JSON-lines file"),
                                             ('{"shape": "tiny"}\n{"shape": \n', "results.jsonl:2 is not a whole JSON line")])
def test_a_missing_or_broken_results_file_is_one_line(tmp_path, capsys, content, message):
    results = tmp_path / "results.jsonl"
    if content is not None:
        results.write_text(content)
    readme = tmp_path / "README.md"
    readme.write_text("untouched")
    for flag in ("--table", "--bubble"):
        with pytest.raises(SystemExit) as stopped:
            bench.main([flag, str(results), "--readme", str(readme)])
        err = capsys.readouterr().err.strip().splitlines()
        assert stopped.value.code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)
    assert readme.read_text() == "untouched"


def test_the_experts_benchmark_refuses_a_machine_without_cuda_and_splits_rows_evenly(capsys, monkeypatch):
    from models.presets import get_model_config
    from tools import bench_experts

    monkeypatch.setattr(bench_experts.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        bench_experts.main(["--setups", "mixtral-small"])
    assert stopped.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    for shape in bench_experts.SHAPES:
        cfg = get_model_config(shape)
        dim, ffn, rows, counts = bench_experts._rows_and_counts(shape)
        assert (dim, ffn, rows) == (cfg.dim, cfg.expert_ffn_dim, bench_experts.TOKENS * cfg.top_k)
        assert counts.sum() == rows and counts.numel() == cfg.num_experts and len(set(counts.tolist())) == 1


def test_experts_table_keeps_the_newest_row_of_each_way_and_each_shape_together(tmp_path):
    path = tmp_path / bench_tables.EXPERTS_FILE
    assert bench_tables.experts_table(path).startswith("(no experts runs")

    def row(shape, way, ms, commit):
        experts, ffn, rows = (8, 8192, 16384) if shape == "mixtral-small" else (64, 1408, 49152)
        return {"shape": shape, "way": way, "rows": rows, "experts": experts, "dim": 2048, "expert_ffn_dim": ffn,
                "ms": ms, "tflops": 3 * 2 * 3 * rows * 2048 * ffn / ms / 1e9, "device": "NVIDIA H200",
                "date": "2026-12-02", "commit": commit}

    rows = [row("mixtral-small", "torch bf16 grouped_mm", 9.5, "old"), row("deepseek-v2-lite", "torch bf16 grouped_mm", 5.9, "a"),
            row("mixtral-small", "te delayed GroupedLinear", 8.1, "a"), row("mixtral-small", "torch bf16 grouped_mm", 8.8, "new")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = bench_tables.experts_table(path).splitlines()[2:]
    assert [line.split(" | ")[3] for line in lines] == ["torch bf16 grouped_mm", "te delayed GroupedLinear",
                                                        "torch bf16 grouped_mm"]
    assert [line.split(" | ")[0] for line in lines] == ["| mixtral-small", "| mixtral-small", "| deepseek-v2-lite"]
    assert "8.80" in lines[0] and "9.50" not in "\n".join(lines)


def test_an_moe_blocks_routing_and_permutation_kernels_have_their_own_category():
    from dtrain.diagnose.breakdown import classify

    for name in ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>",
                 "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", "triton_poi_fused_index_mul_sum_3",
                 "triton_poi_fused_scatter_add_zeros_1", "aten::argsort"):
        assert classify(name) == "routing", name
    assert classify("triton_poi_fused_add_mul_silu_0") == "elementwise"
    assert classify("triton_red_fused_gather_log_softmax_2", "loss") == "loss"  # the head's, by its range
    assert classify("triton_poi_fused_index_put_5", "fsdp") == "fsdp"
