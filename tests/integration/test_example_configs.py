"""The example configs under configs/ load and fit: each is checked the way its header tells a
user to check it (the dry run for dense models, --print-plan for MoE models, which the dry run
does not run), and no rank is flagged as not fitting its GPU. --print-plan and the dry run say
what they assume and flag a rank that does not fit."""

from __future__ import annotations

import pytest

from dtrain.config import load_config
from dtrain.run import main
from tests.launch import REPO


CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def test_the_common_runs_have_an_example_config():
    models = {load_config(["--config", str(path)]).model.model for path in CONFIGS}
    assert {"llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3"} <= models


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_an_example_config_fits_as_its_header_checks_it(path, capsys):
    header = path.read_text().split("\n[", 1)[0]
    check = "--dry-run" if "--dry-run" in header else "--print-plan"
    assert f"python -m dtrain.run --config configs/{path.name} {check}" in header
    extra = ["--dry-run-rank", "0"] if check == "--dry-run" else []  # the fullest rank of each: the first stage's
    assert main(["--config", str(path), check, *extra]) == 0
    out = capsys.readouterr().out
    config = load_config(["--config", str(path)])
    assert f"assumed: sequences of {config.data.seq_len} tokens" in out, out[-2000:]
    assert "DOES NOT FIT" not in out, out[-3000:]


def test_print_plan_flags_a_rank_that_does_not_fit_and_says_what_it_assumed(capsys):
    assert main(["--model", "deepseek-v3", "--mesh", "pp=4,dp=8", "--print-plan"]) == 0
    out = capsys.readouterr().out
    assert ("assumed: sequences of 256 tokens (--seq-len), micro-batch 4, global batch 256, GPUs of 80 GB (no GPU "
            "here: the default; --gpu-memory-gb to change)") in out
    rows = [line for line in out.splitlines() if line.startswith("  pp rank")]
    assert len(rows) == 4 and all("DOES NOT FIT a 80 GB GPU: python -m dtrain.planner --model deepseek-v3 --gpus 32"
                                  in row for row in rows), rows
    assert main(["--model", "llama3-8b", "--mesh", "pp=4,dp=8", "--print-plan", "--gpu-memory-gb", "4000"]) == 0
    out = capsys.readouterr().out
    assert "GPUs of 4000 GB (--gpu-memory-gb)" in out and "DOES NOT FIT" not in out


def test_the_dry_run_names_its_two_peaks_and_flags_a_measured_one_above_the_gpu(capsys):
    assert main(["--model", "tiny", "--mesh", "dp=2", "--dry-run", "--gpu-memory-gb", "0.001"]) == 0
    out = capsys.readouterr().out
    measured = next(line for line in out.splitlines() if "peak memory, measured by this dry run:" in line)
    assert "DOES NOT FIT a 0.001 GB GPU" in measured
    assert "peak memory, predicted by the planner's memory model (--print-plan):" in out
