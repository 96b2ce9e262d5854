"""Stragglers: each rank's forward compute time, compared with the median of its peers; a rank
that stays slower is named, and the step's numbers do not change."""

from __future__ import annotations

from dtrain.resilience.stragglers import StragglerReport


def test_a_rank_is_named_after_three_slow_checks_in_a_row_and_only_then():
    report = StragglerReport()
    ratio, warnings = report.check(10, [1.0, 1.5], [0, 0])
    # The lower middle value is the median: with two ranks the slow one meets the other, not their mean.
    assert ratio == 1.5 and warnings == []
    assert report.check(20, [1.0, 1.5], [0, 0])[1] == []
    report.check(30, [1.0, 1.1], [0, 0])  # back to normal: the count starts again
    for step in (40, 50):
        assert report.check(step, [1.0, 1.0, 1.0, 2.0], [0, 0, 0, 0])[1] == []
    ratio, [warning] = report.check(60, [1.0, 1.0, 1.0, 2.0], [0, 0, 0, 0])
    assert ratio == 2.0 and warning.startswith("straggler: rank 3 computed 2.00x the median time of its peers "
                                               "at the last 3 checks (steps 40, 50, 60)")
    assert report.check(70, [1.0, 1.0, 1.0, 2.0], [0, 0, 0, 0])[1] == []  # named once per episode


def test_pipeline_stages_are_compared_with_the_same_stage_of_other_pipelines():
    # Stage 1 (blocks and the head) takes longer than stage 0 on every rank: nobody straggles.
    ratio, _ = StragglerReport().check(5, [1.0, 3.0, 1.0, 3.0], [0, 1, 0, 1])
    assert ratio == 1.0
    ratio, _ = StragglerReport().check(5, [1.0, 3.0, 1.0, 4.5], [0, 1, 0, 1])
    assert ratio == 1.5
