"""The planner against the runs others published at scale (benchmarks/published_runs.jsonl): every
published layout fits, its predicted tokens/s per GPU is within the tolerance or on the side that
its recorded gap says, and the search at the same GPUs reaches the published layout's prediction."""

from __future__ import annotations

import json

import pytest

from dtrain.planner import published
from dtrain.planner.measured import run_options
from tests.launch import REPO

RUNS = REPO / "benchmarks" / "published_runs.jsonl"
RESULTS = REPO / "benchmarks" / "results.jsonl"


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
