"""The planner on a user's cluster: GPU profiles, a given layout evaluated (fixed choices, fits or
not, what bounds its step), and the layouts published runs use (ZeRO-1, plain DDP, any number of
virtual stages) in the search."""

from __future__ import annotations

import json

import attrs
import pytest

from dtrain.layout import Machine
from dtrain.planner import __main__ as planner_cli
from dtrain.planner import gpus, memory
from dtrain.planner.candidates import Fixed, Target
from dtrain.planner.hardware import H200
from dtrain.planner.search import search
from tests.layouts import resolved


GB = 1e9


def test_the_h200_profile_is_the_measured_one_and_the_others_scale_by_their_datasheets():
    assert gpus.profile("h200") == attrs.evolve(H200, name="h200")
    h100, b200, a100, h800 = (gpus.profile(name) for name in ("h100-sxm", "b200", "a100-80gb", "h800"))
    # Same compute die as the H200, less HBM bandwidth and memory.
    assert h100.gemm_tflops == H200.gemm_tflops and h100.hbm_tb_s == pytest.approx(H200.hbm_tb_s * 3.35 / 4.8)
    assert h100.gpu_memory_gb == 80 and h800.nvlink_gb_s == pytest.approx(H200.nvlink_gb_s * 400 / 900)
    assert b200.gemm_tflops == pytest.approx(H200.gemm_tflops * 2250 / 989) and b200.peak_tflops == 2250
    # No FP8 matmuls on an A100: FP8 recipes run at its BF16 rate.
    assert a100.fp8_gemm_tflops == a100.gemm_tflops and a100.inter_node_gb_s == 25
    assert gpus.profile("b200", memory_gb=192, inter_node_gb_s=100).gpu_memory_gb == 192
    # A power-limited part: its peaks scaled by the share its clocks sustain, its HBM by its own.
    hbm2e = gpus.profile("h100-hbm2e")
    assert hbm2e.gemm_tflops == pytest.approx(H200.gemm_tflops * 0.92) and hbm2e.peak_tflops == 989
    assert hbm2e.hbm_tb_s == pytest.approx(H200.hbm_tb_s * 2.4 / 4.8) and hbm2e.gpu_memory_gb == 96
    assert gpus.ratios("h800")["nvlink_gb_s"] == pytest.approx(400 / 900)
    table = gpus.profiles_table()
    assert "| h800 | H800 SXM |" in table and "| h200 | H200 SXM |" in table and "measured" in table


def test_the_same_layout_runs_faster_on_faster_gpus():
    fixed = Fixed(mesh="dp_shard=8", micro_batch=1, recompute="full")
    speeds = {}
    for gpu in ("a100-80gb", "h100-sxm", "h200", "b200"):
        [best] = search(Target(model="llama3-8b", gpus=8, seq_len=8192, global_batch=16, gpu=gpu, fixed=fixed))[:1]
        speeds[gpu] = best.tokens_per_sec_per_gpu
        assert best.gpu == gpu and best.memory.total <= gpus.DATASHEETS[gpu].memory_gb * GB
    assert speeds["a100-80gb"] < speeds["h100-sxm"] < speeds["h200"] < speeds["b200"]
    # MFU is over each GPU's own dense BF16 peak.
    assert 0.2 < best.step.mfu() < 0.8


def test_a_given_layout_keeps_what_is_fixed_and_searches_the_rest(capsys):
    argv = ["--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm", "--seq-len", "8192", "--global-batch", "128",
            "--mesh", "pp=8,dp_shard=2,tp=4", "--pp-virtual-stages", "5", "--dp-mode", "zero1", "--json", "--top", "1"]
    assert planner_cli.main(argv) == 0
    [given] = json.loads(capsys.readouterr().out)
    assert given["mesh"] == "pp=8,dp_shard=2,tp=4" and given["pp_virtual_stages"] == 5
    assert given["pp_schedule"] == "interleaved-1f1b" and given["dp_mode"] == "zero1"
    assert given["fits"] is True and given["gpu"] == "h100-sxm" and given["memory_gb"] <= 80
    for key in ("mesh", "micro_batch", "recompute", "memory_gb", "memory_breakdown_gb", "tokens_per_sec_per_gpu",
                "mfu", "command", "step_breakdown_s"):
        assert key in given
    parts = given["step_breakdown_s"]
    assert {"compute", "tp", "pp", "bubble", "optimizer"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(given["step_seconds"], rel=1e-3)
    # The command runs that layout, and its prediction is the planner's.
    layout = resolved(given["command"].split(" -m dtrain.run ", 1)[1].split(), 64, Machine.gpu_profile("h100-sxm"))
    config = layout.config
    assert config.parallel.pp_virtual_stages == 5 and config.parallel.dp_mode == "zero1"
    assert memory.predict_peak(layout)[0].total / GB == pytest.approx(given["memory_gb"], abs=0.01)


def test_a_given_layout_that_does_not_fit_is_reported_with_its_memory(capsys):
    argv = ["--model", "llama3-70b", "--gpus", "8", "--gpu", "h100-sxm", "--seq-len", "8192", "--global-batch", "8",
            "--mesh", "tp=8", "--micro-batch", "1", "--no-cpu-offload"]
    assert planner_cli.main([*argv, "--json"]) == 0
    [given] = json.loads(capsys.readouterr().out)
    assert given["fits"] is False and given["memory_gb"] > 80 and given["recompute"] == "full"
    assert planner_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "0 layouts fit" in out and "the nearest:" in out and "fits false" in out and "bound by: " in out


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "dp_shard=8,ep=2"], "ep=2 needs a mixture-of-experts model"),
    (["--mesh", "dp_shard=8", "--micro-batch", "3"], "no micro-batch"),
    (["--micro-batch", "0"], "--micro-batch 0 must be >= 1"),
    (["--gpu", "h100-sxm", "--gpu-memory-gb", "-1"], "must be positive"),
])
def test_bad_given_layouts_are_one_clear_line(argv, message, capsys):
    assert planner_cli.main(["--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dtrain.planner: error: ") and message in err and "\n" not in err


def test_the_step_says_what_bounds_it():
    [given] = search(Target(model="llama3-70b", gpus=64, seq_len=8192, global_batch=64, gpu="h100-sxm",
                            fixed=Fixed(mesh="pp=8,dp_shard=2,tp=4", pp_schedule="1f1b", micro_batch=1)))[:1]
    line = given.step.bound_by()
    assert line.startswith(("tp collectives", "pp bubble")) and "pp bubble" in line and "%" in line
    breakdown = given.step.breakdown()
    assert breakdown["bubble"] / given.step.seconds > 0.1  # 7 of 15 micro-batch slots idle per rank


def test_published_layouts_are_in_the_search():
    """ZeRO-1, plain DDP and virtual stages other than 2 and 4 are candidates of the search."""
    small = search(Target(model="llama-1b", gpus=16, seq_len=4096, global_batch=64, gpu="h100-sxm"))
    meshes = {(c.mesh, c.config.parallel.dp_mode) for c in small}
    assert ("dp_replicate=16", "fsdp") in meshes and ("dp_shard=16", "zero1") in meshes
    deep = search(Target(model="llama3-70b", gpus=64, seq_len=8192, global_batch=128, gpu="h100-sxm",
                         fixed=Fixed(mesh="pp=8,dp_shard=2,tp=4")))
    assert {c.config.parallel.pp_virtual_stages for c in deep} >= {1, 2, 3, 4, 5, 10}


def test_refresh_writes_each_planner_output_that_a_page_shows(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- python -m dtrain.planner --profiles -->\nstale\n<!-- end of python -m dtrain.planner -->\n"
                    "between\n<!-- python -m dtrain.planner --model llama3-8b --gpus 8 --global-batch 16 --top 1 -->\n"
                    "<!-- end of python -m dtrain.planner -->\nend\n")
    assert planner_cli.main(["--refresh", str(page)]) == 0
    text = page.read_text()
    assert "stale" not in text and "| h800 | H800 SXM |" in text and "1. --mesh " in text
    assert text.startswith("intro\n") and "\nbetween\n" in text and text.endswith("end\n")
    assert capsys.readouterr().out.count("wrote the output of python -m dtrain.planner") == 2
