"""The planner against the runs others published at scale (benchmarks/published_runs.jsonl): every
published layout fits, its predicted tokens/s per GPU is within the tolerance or on the side that
its recorded gap says, and the search at the same GPUs reaches the published layout's prediction."""

from __future__ import annotations


import pytest

from dtrain.config import load_config
from dtrain.layout import Machine, resolve
from dtrain.planner import published
from tests.unit.test_planner_published import RUNS


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
