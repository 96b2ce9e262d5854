"""`python -m dtrain.diagnose`: tiny CPU runs with one planted fault each (a NaN and a loss spike, a
slow data loader, a too-small micro-batch, an out-of-memory error, a straggling rank), each read
back and named for what it is, and a healthy run in which nothing is named."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from dtrain.diagnose import journal
from dtrain.diagnose.__main__ import diagnose, main
from dtrain.diagnose.record import load
from dtrain.diagnose.report import MAX_LINES
from dtrain.planner import advice, memory
from dtrain.planner.search import search
from dtrain.resilience import failures
from dtrain.resilience.faults import SPIKE_FACTOR
from tests.launch import run_cli
from tests.layouts import resolved


# The tiny CPU shape, one micro-batch per step (the planner's best for it, so a healthy run asks
# for no other layout) and a warm-up the runs finish.
ARGS = ["--model", "tiny", "--seed", "0", "--precision", "fp32", "--seq-len", "64", "--global-batch", "8",
        "--micro-batch", "8", "--lr", "1e-3", "--warmup-steps", "2"]


DATA_SECONDS = 0.3


def _train(run_dir, extra: list[str], module: str = "dtrain.run", nproc: int = 1, env=None, code: int = 0):
    result = run_cli([*ARGS, "--run-dir", str(run_dir), *extra], nproc=nproc, module=module, env=env)
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run directory per fault, made the first time a test asks for it."""
    made = {}
    planted = {
        "healthy": lambda d: _train(d, ["--steps", "6"]),
        "loss": lambda d: _train(d, ["--steps", "12"], env={"DTRAIN_FAULT": "nan@step4,spike@step10"}),
        "data": lambda d: _train(d, ["--steps", "4"], module="tests.workers.slow_data",
                                 env={"DTRAIN_TEST_DATA_SECONDS": str(DATA_SECONDS)}),
        "micro_batch": lambda d: _train(d, ["--steps", "3", "--micro-batch", "1"]),
        "oom": lambda d: _train(d, ["--steps", "4", "--gpu-memory-gb", str(_limit_between())],
                                env={"DTRAIN_FAULT": "oom@step2"}, code=2),
    }

    def get(name: str):
        if name not in made:
            made[name] = planted[name](tmp_path_factory.mktemp(name))
        return made[name]
    return get


def _layout(*extra: str):
    return resolved([*ARGS, *extra])


def _limit_between() -> float:
    """A GPU memory between the planner's peak for ARGS and for its least-memory micro-batch and
    recompute: ARGS does not fit, a neighbour does."""
    peak = memory.predict_peak(_layout())[0].total / 1e9
    least = memory.predict_peak(_layout("--micro-batch", "1", "--recompute", "full"))[0].total / 1e9
    assert least < peak
    return round((least + peak) / 2, 4)


def _diagnosed(run_dir):
    result = diagnose(load(run_dir))
    text = result.text()
    assert len(text.splitlines()) <= MAX_LINES, text
    return result, text


def _kinds(result) -> list[tuple[str, int | None]]:
    return [(f.kind, f.step) for f in result.findings]


def test_a_healthy_run_reports_nothing_wrong(runs):
    result, text = _diagnosed(runs("healthy"))
    assert result.findings == [], text
    assert text.endswith("nothing wrong found")
    # On the CPU the planner's GPU rates are no yardstick: no measured-against-predicted ratio.
    assert "no yardstick for this CPU run" in text and "of it" not in text


def test_the_journal_has_a_start_and_every_step(runs):
    run_dir = runs("healthy")
    record = journal.read(run_dir)
    assert [s["step"] for s in record.steps] == list(range(1, 7)) and record.restarts == []
    start = record.first_start
    assert start["world_size"] == 1 and start["device"] == "cpu" and start["attempt"] == [0, 0]
    assert start["layout"] == advice.evaluate(load(run_dir).layout).as_json()
    for step in record.steps:
        assert {"loss", "grad_norm", "lr", "skipped", "step_s", "data_s", "peak_gb", "tokens_per_s"} <= set(step)
        assert 0 < step["data_s"] < step["step_s"] and "device_s" not in step  # a GPU's time: GPUs only


def test_a_nan_and_a_loss_spike_are_named_with_what_the_guard_did(runs):
    result, text = _diagnosed(runs("loss"))
    assert _kinds(result) == [("nan", 4), ("spike", 10)], text
    assert "step 4: loss nan, gradient norm nan: the guard skipped its update" in text
    spike = load(runs("loss")).steps[9]
    line = next(line for line in text.splitlines() if "step 10: loss spike" in line)
    ratio = float(line.split(", ")[1].split("x the running median")[0])
    # The fault multiplies the step's loss by SPIKE_FACTOR; the median is of the steps before it.
    assert SPIKE_FACTOR / 2 < ratio < SPIKE_FACTOR * 2 and spike["loss"] > 50
    assert "(--skip-spikes is off)" in line and "no gradient-norm growth before it" in line
    spike_finding = result.findings[1]
    assert spike_finding.flags == "--skip-spikes 3" and "remedy: --skip-spikes 3" in text


def test_a_slow_data_loader_is_named(runs):
    result, text = _diagnosed(runs("data"))
    assert _kinds(result) == [("slow_data", None)], text
    speed = result.sections[0].figures
    assert speed["exposed_data_s"] >= DATA_SECONDS and speed["exposed_data_s"] <= speed["measured_step_s"]


def test_a_too_small_micro_batch_gets_the_planners_best_as_flags(runs):
    run_dir = runs("micro_batch")
    result, text = _diagnosed(run_dir)
    record = load(run_dir)
    best = search(record.target)[0]
    assert best.config.data.micro_batch > 1  # the planner's best for the shape, not this run's
    assert _kinds(result) == [("layout", None)], text
    assert result.findings[0].flags == f"--micro-batch {best.config.data.micro_batch}"
    suggestion = result.sections[0].figures["suggestions"][0]
    assert suggestion["tokens_per_sec_per_gpu"] == round(best.tokens_per_sec_per_gpu, 1) and suggestion["gain"] > 0.05


def test_an_out_of_memory_run_gets_the_nearest_layout_that_fits(runs):
    run_dir = runs("oom")
    result, text = _diagnosed(run_dir)
    assert _kinds(result) == [("out_of_memory", 2)], text
    record = load(run_dir)
    limit = record.gpu_memory_gb
    assert memory.predict_peak(record.layout)[0].total / 1e9 > limit
    # The finding's flags, applied to the run's command line, give a layout the planner fits.
    flags = result.findings[0].flags.split()
    fixed = _layout(*flags)
    assert fixed.config.data.micro_batch < record.config.data.micro_batch or fixed.config.train.recompute != "none"
    assert memory.predict_peak(fixed)[0].total / 1e9 <= limit
    assert "rank 0 ran out of memory at step 2" in text and "more than the" in text


@pytest.mark.slow
def test_a_straggling_rank_is_named(tmp_path):
    """Rank 1's layers each take 30 ms longer (tests.workers.slow_rank), checked every 2 steps."""
    run_dir = _train(tmp_path, ["--steps", "6", "--straggler-every", "2", "--micro-batch", "4"], nproc=2,
                     module="tests.workers.slow_rank",
                     env={"DTRAIN_TEST_SLOW_RANK": "1", "DTRAIN_TEST_SLOW_SECONDS": "0.03"})
    result, text = _diagnosed(run_dir)
    stragglers = [f for f in result.findings if f.kind == "straggler"]
    assert len(stragglers) == 1 and stragglers[0].text.startswith("rank 1 computed "), text
    assert " in 3 of 3 checks" in stragglers[0].text and "of each step (its forward alone)" in stragglers[0].text


def test_a_hang_and_a_restart_are_named(runs, tmp_path):
    """A hang's record (the watchdog's line) and a restart from step 4 after step 6 in the journal."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs("healthy"), run_dir)
    what = "hang: rank 1 stopped responding in step 6 (forward) or just after: no heartbeat for 130 s"
    failures.record(run_dir, failures.Failure(1, 6, "forward", "hang", what, "stopped rank 1 at forward"))
    lines = (run_dir / journal.JOURNAL).read_text().splitlines()
    start, steps = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    writer = journal.JournalWriter(run_dir)
    writer.write({**start, "step": 4, "attempt": [0, 1], "time": steps[-1]["time"] + 60})
    for step in steps[4:]:
        writer.write({**step, "loss": step["loss"] + 1, "time": step["time"] + 70})
    writer.close()
    record = load(run_dir)
    assert [s["step"] for s in record.steps] == list(range(1, 7))
    assert [s["loss"] for s in record.steps[4:]] == [s["loss"] + 1 for s in steps[4:]]  # redone steps replace
    [restart] = record.journal.restarts
    assert (restart.step, restart.reached, restart.attempt) == (4, 6, (0, 1))
    result, text = _diagnosed(run_dir)
    assert ("hang", 6) in _kinds(result) and what in text
    assert "1 restart (at step 4): 2 steps redone" in text


def test_a_gpu_run_slower_than_predicted_is_named(runs, tmp_path):
    """The GPU's side on a CPU: a journal whose start says H200 and whose steps ran at a third of
    the planner's prediction."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs("healthy"), run_dir)
    path = run_dir / journal.JOURNAL
    records = [json.loads(line) for line in path.read_text().splitlines()]
    predicted = records[0]["layout"]["tokens_per_sec_per_gpu"]
    records[0].update(device="NVIDIA H200", gpu="h200", gpu_memory_gb=141.0)
    for r in records[1:]:
        r.update(tokens_per_s=predicted / 3, mfu=1.0, device_s=r["step_s"] / 4)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result, text = _diagnosed(run_dir)
    assert _kinds(result) == [("slower_than_predicted", None)], text
    assert "measured is 33% of it" in text and "no yardstick" not in text
    assert "of the step, GPU idle 75%" in text


def test_the_command_line(runs, tmp_path, capsys, monkeypatch):
    run_dir = runs("loss")
    assert main([str(run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(f["kind"], f["step"]) for f in out["findings"]] == [("nan", 4), ("spike", 10)]
    assert out["loss"]["spikes"] == [10] and out["loss"]["non_finite"] == [4]
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dtrain.diagnose: error: ") and "no config.toml" in err and "\n" not in err
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(builtins, "__import__", no_matplotlib)
        assert main([str(run_dir), "--plot", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dtrain.diagnose: error: --plot needs matplotlib: pip install matplotlib (or pip install -e " \
                  "'.[diagnose]')"


def test_the_plot_marks_the_events(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from dtrain.diagnose.plot import events

    run_dir = runs("loss")
    assert events(load(run_dir))["non-finite"] == [4] and events(load(run_dir))["spike"] == [10]
    assert main([str(run_dir), "--plot", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_profile_says_where_the_step_goes(runs, tmp_path):
    """A summary of python -m tools.bench --profile, and a trace torch.profiler exported."""
    import torch

    from dtrain.diagnose.profile import load_profile

    summary = {"rank": 0, "steps": 3, "step_ms": 40.0, "ms": {"gemm": 20.0, "attention": 6.0, "communication": 10.0},
               "idle_ms": 4.0}
    (tmp_path / "profile_rank0.json").write_text(json.dumps(summary))
    shares = load_profile(tmp_path)
    assert shares == {"gemm": 0.5, "communication": 0.25, "attention": 0.15, "idle": 0.1}
    result = diagnose(load(runs("healthy")), shares)
    assert "where the step goes (profile): gemm 50%, communication 25%, attention 15%, idle 10%" in result.text()
    x = torch.randn(128, 128, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (x @ x).relu().sum().backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    shares = load_profile(tmp_path / "trace.json")
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-6) and shares["gemm"] > 0
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(Exception, match="neither a python -m tools.bench --profile summary nor a Chrome trace"):
        load_profile(tmp_path / "bad.json")


def _block(page: str, example: str) -> str:
    from tools.diagnose_example import END_MARKER

    begin = f"<!-- python -m tools.diagnose_example {example} -->\n"
    assert begin in page, f"docs/troubleshooting.md has no {begin.strip()}"
    text = page.split(begin, 1)[1].split(END_MARKER, 1)[0].strip()
    return text.removeprefix("```text\n").removesuffix("\n```")


def test_the_troubleshooting_page_shows_what_diagnose_prints(tmp_path):
    """The page's CPU example reads as diagnose prints it today (its measured numbers aside), and
    its table of thresholds is diagnose's."""
    import re

    from tests.launch import REPO
    from tools.diagnose_example import CPU_ARGS, CPU_FAULTS, cpu_text, thresholds_table

    page = (REPO / "docs" / "troubleshooting.md").read_text()
    assert _block(page, "thresholds") == thresholds_table()
    result = run_cli([*CPU_ARGS, "--run-dir", str(tmp_path)], env={"DTRAIN_FAULT": CPU_FAULTS})
    assert result.returncode == 0, result.stderr[-3000:]

    def masked(text: str) -> list[str]:
        return [re.sub(r"\d[\d,.]*", "#", line) for line in text.splitlines()]

    assert masked(_block(page, "cpu")) == masked(cpu_text(tmp_path)), \
        "regenerate it: python -m tools.diagnose_example cpu --readme docs/troubleshooting.md"


def test_a_run_that_failed_while_it_built_is_still_diagnosed(runs, tmp_path):
    """No journal line (an out-of-memory error while the model was built): the world from the
    failure records, the nearest layout that fits all the same."""
    (tmp_path / "config.toml").write_text((runs("oom") / "config.toml").read_text())
    failures.record(tmp_path, failures.Failure(0, 0, "data", "error", "rank 0 at step 0 (data): OutOfMemoryError: "
                                               "CUDA out of memory. Tried to allocate 2.00 GiB",
                                               "OutOfMemoryError: CUDA out of memory"))
    record = load(tmp_path)
    assert record.world_size == 1 and record.on_gpu
    result, text = _diagnosed(tmp_path)
    assert _kinds(result) == [("out_of_memory", 0)], text
    assert result.findings[0].flags.startswith("--micro-batch ") and "no journal" in text.splitlines()[0]
    (tmp_path / "failures").rename(tmp_path / "gone")
    assert main([str(tmp_path)]) == 2


@pytest.mark.gpu
def test_a_gpu_run_journals_the_devices_time_and_is_compared_with_the_planner(tmp_path):
    import torch

    run_dir = _train(tmp_path, ["--steps", "6", "--precision", "bf16"])
    record = load(run_dir)
    assert record.on_gpu and record.device == torch.cuda.get_device_name()
    for step in record.steps:
        assert 0 < step["device_s"] <= step["step_s"] * 1.5 and step["mfu"] > 0
    result, text = _diagnosed(run_dir)
    assert "measured is " in text and "no yardstick" not in text
