"""Fault injection (`DTRAIN_FAULT`): the grammar, which rank a fault hits, and that it fires once."""

import math

import pytest

from dtrain.resilience.faults import SPIKE_FACTOR, Fault, FaultInjector, parse
from models.errors import UserError


def test_the_grammar_and_its_one_line_errors():
    assert parse("crash@step5, hang@rank1:step3,nan@rank0:step12") == [
        Fault("crash", 5), Fault("hang", 3, rank=1), Fault("nan", 12, rank=0)]
    assert parse("") == []
    for bad in ("boom@step1", "crash@5", "crash@rank:step2", "nan@step"):
        with pytest.raises(UserError, match=r"bad entry .*KIND@stepS or KIND@rankR:stepS") as info:
            parse(f"spike@step1,{bad}")
        assert "\n" not in str(info.value)


def test_a_fault_hits_its_rank_once_even_after_a_restart(tmp_path):
    text = "nan@rank1:step2,spike@step3"
    rank0, rank1 = FaultInjector(0, tmp_path, text), FaultInjector(1, tmp_path, text)
    assert [rank0.loss_factor(step) for step in (1, 2, 3)] == [1.0, 1.0, SPIKE_FACTOR]
    factors = [rank1.loss_factor(step) for step in (1, 2, 3)]
    assert factors[0] == 1.0 and math.isnan(factors[1]) and factors[2] == SPIKE_FACTOR
    # A restarted run (a new injector over the same run directory) passes those steps unharmed.
    again = FaultInjector(1, tmp_path, text)
    assert [again.loss_factor(step) for step in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert not FaultInjector(0, tmp_path, "")
