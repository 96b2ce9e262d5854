"""The planner against the runs others published at scale (benchmarks/published_runs.jsonl): every
published layout fits, its predicted tokens/s per GPU is within the tolerance or on the side that
its recorded gap says, and the search at the same GPUs reaches the published layout's prediction."""

from __future__ import annotations

import json

import pytest

from dtrain.config import load_config
from dtrain.layout import Machine, resolve
from dtrain.planner import published
from dtrain.planner.measured import run_options
from tests.launch import REPO

RUNS = REPO / "benchmarks" / "published_runs.jsonl"
RESULTS = REPO / "benchmarks" / "results.jsonl"


def test_every_published_layout_fits_and_is_predicted_within_the_tolerance_or_its_recorded_gap():
    comparisons = published.compare(RUNS, searched=False)
    assert len(comparisons) >= 26
    for c in comparisons:
        r, given = c.run.data, c.given
        assert given.fits, r["id"]
        # The candidate is the published layout, with each published choice as given.
        config = load_config(given.command.split(" -m dtrain.run ", 1)[1].split())
        resolve(config, r["gpus"], Machine.gpu_profile(r["gpu"]))  # as a run on those GPUs checks it
        assert config.parallel.mesh == r["mesh"] and config.parallel.dp_mode == r["dp_mode"], r["id"]
        for name, value in (("micro_batch", config.data.micro_batch), ("recompute", config.train.recompute),
                            ("pp_schedule", config.parallel.pp_schedule),
                            ("pp_virtual_stages", config.parallel.pp_virtual_stages)):
            assert r[name] is None or r[name] == value, (r["id"], name)
    errors = {c.run.id: round(c.error, 3) for c in comparisons}
    unexplained = {run: error for run, error in errors.items() if abs(error) > published.TOLERANCE
                   and run not in published.GAPS}
    explained_but_within = {run: error for run, error in errors.items() if run in published.GAPS
                            and abs(error) <= published.TOLERANCE}
    sides = {"under": -1, "over": 1}
    wrong_side = {run: error for run, error in errors.items() if run in published.GAPS
                  and error * sides[published.GAP_REASONS[published.GAPS[run]][0]] < 0}
    assert not unexplained and not explained_but_within and not wrong_side, (unexplained, explained_but_within,
                                                                              wrong_side)
    assert set(published.GAPS) <= set(errors)


@pytest.mark.parametrize("run", published.read_runs(RUNS), ids=lambda run: run.id)
def test_the_search_at_the_same_gpus_reaches_the_published_layouts_prediction(run):
    """Same precision; CPU offload only where the published layout needs it (none does)."""
    c = published.compare_run(run)
    assert c.searched is not None and c.ratio >= published.SEARCH_RATIO, (c.ratio, c.searched.mesh)
    assert not c.searched.config.parallel.cpu_offload or c.given.config.parallel.cpu_offload
    assert c.searched.config.train.fp8 == run.data["fp8"]


def test_the_published_table_names_every_run_and_why_the_misses_miss(tmp_path):
    runs = RUNS.read_text().splitlines()
    two = tmp_path / "runs.jsonl"
    # One run within the tolerance and one recorded gap.
    two.write_text("\n".join(line for line in runs if '"mlm-ws-gpt16b-192"' in line or '"tt-llama31-8b-h100-8-bf16"' in line))
    text = published.published_text(two, RESULTS)
    assert "| mlm-ws-gpt16b-192 | 192 | h100-sxm |" in text and "1 of 2 runs within 15%" in text
    assert "2 of 2 published layouts fit" in text
    assert "predicted over the published figure (tt-llama31-8b-h100-8-bf16 +" in text
    # The reason quotes the run's published MFU and dtrain's measured one, from the files that hold them.
    assert "ran Llama 3.1 8B in bf16 at 39% MFU" in text
    measured = [line for line in RESULTS.read_text().splitlines() if line.startswith("{")]
    newest = max(i for i, line in enumerate(measured) if json.loads(line)["shape"] == "llama-8b"
                 and json.loads(line)["mesh"] == "dp=2" and run_options(json.loads(line)) == ["--compile"])
    mfu = json.loads(measured[newest])["mfu_pct"]
    assert f"dtrain measured {mfu:.0f}% MFU on the same shape" in text
    changed = tmp_path / "results.jsonl"
    changed.write_text("\n".join(measured + [json.dumps(json.loads(measured[newest]) | {"mfu_pct": 12.3})]))
    assert "dtrain measured 12% MFU on the same shape" in published.published_text(two, changed)


@pytest.mark.parametrize("line,message", [
    ('{"id": "x"', "is not a whole JSON line"),
    ('{"id": "x", "model": "llama3-8b"}', "the run x lacks url, model_overrides"),
])
def test_a_bad_runs_file_is_one_clear_line(tmp_path, line, message):
    bad = tmp_path / "runs.jsonl"
    bad.write_text(line + "\n")
    with pytest.raises(published.UserError, match=None) as error:
        published.read_runs(bad)
    assert message in str(error.value) and "\n" not in str(error.value)
