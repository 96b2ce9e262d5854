"""The planner against the runs others published at scale (benchmarks/published_runs.jsonl): every
published layout fits, its predicted tokens/s per GPU is within the tolerance or on the side that
its recorded gap says, and the search at the same GPUs reaches the published layout's prediction."""

from __future__ import annotations

import pytest

from dtrain.planner import published
from tests.launch import REPO


RUNS = REPO / "benchmarks" / "published_runs.jsonl"


def test_the_published_table_names_every_run_and_why_the_misses_miss(tmp_path):
    runs = RUNS.read_text().splitlines()
    two = tmp_path / "runs.jsonl"
    # One run within the tolerance and one recorded gap.
    two.write_text("\n".join(line for line in runs if '"mlm-ws-gpt16b-192"' in line or '"tt-llama31-8b-h100-8-bf16"' in line))
    text = published.published_text(two)
    assert "| mlm-ws-gpt16b-192 | 192 | h100-sxm |" in text and "1 of 2 runs within 15%" in text
    assert "2 of 2 published layouts fit" in text
    assert "predicted over the published figure (tt-llama31-8b-h100-8-bf16 +" in text


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
