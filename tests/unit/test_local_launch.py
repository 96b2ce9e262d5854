"""`python -m dtrain.run --nproc-per-node N`: the ranks of one machine started by dtrain itself, so
that a failed run ends in one line per failure (the rank's own, or the launcher's for a rank that
died without a word) and not in torchrun's report; a run that goes well, and a restart, read as
under torchrun."""

from __future__ import annotations

import re

import pytest

from dtrain.launch import local
from dtrain.run import main
from models.errors import UserError
from tests.launch import TINY_ARGS


@pytest.mark.parametrize("argv,launch,rest", [
    (["--model", "tiny"], None, ["--model", "tiny"]),
    (["--nproc-per-node", "2", "--model", "tiny"], local.Launch(2), ["--model", "tiny"]),
    (["--model", "tiny", "--nproc_per_node=4", "--max-restarts", "3"], local.Launch(4, 3), ["--model", "tiny"]),
])
def test_the_launch_flags_are_taken_out_of_the_training_flags(argv, launch, rest):
    assert local.split(argv) == (launch, rest)


@pytest.mark.parametrize("argv,message", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: give at least 1 rank"),
    (["--nproc-per-node", "two"], "--nproc-per-node needs a whole number, not 'two'"),
    (["--max-restarts", "1"], "--max-restarts restarts the ranks that --nproc-per-node N starts: give both"),
])
def test_a_bad_launch_flag_is_a_user_error(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        local.split(argv)


@pytest.mark.parametrize("failures,first", [
    ({0: 1, 1: -9}, 1),  # rank 0 lost its peer, killed in the same second: the kill is the cause
    ({0: -15, 1: 2}, 1),  # rank 1's mistake; rank 0 stopped by the agent's SIGTERM
    ({1: 2, 0: 2}, 1),  # alike: the one the agent saw first
])
def test_of_failures_in_the_same_second_the_cause_comes_first(failures, first):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    seen = {}
    for rank, exitcode in failures.items():
        seen[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")
        seen[rank].timestamp = 1_700_000_000
    assert local._first_failure(seen)[0] == first


def test_the_agents_own_lines_are_kept_to_what_the_ranks_do_not_say(capsys):
    import logging

    lines = local._AgentLines(logging.WARNING)

    def shown(level: int, msg: str, *args) -> bool:
        return lines.filter(logging.LogRecord("torch", level, __file__, 1, msg, args, None))

    assert not shown(logging.WARNING, "Sending process %s closing signal %s", 4242, "SIGTERM")
    assert not shown(logging.ERROR, "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", -9, 1, 4243, "py")
    assert not shown(logging.INFO, "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
                     "default", "FAILED", 3, 3)
    assert capsys.readouterr().err == "dtrain: rank 1 died with SIGKILL; every rank starts again (restart 1 of 3)\n"
    assert not shown(logging.INFO, "[%s] Rendezvous'ing worker group", "default")
    assert shown(logging.WARNING, "Unable to shutdown process %s via %s, forcefully exiting via %s", 4242, 15, 9)


def test_a_flag_mistake_is_one_line_before_any_rank_starts(tmp_path, capsys):
    assert main(["--nproc-per-node", "2", "--modle", "tiny", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "dtrain: error: unknown flag --modle: did you mean --model? (python -m " \
                                      "dtrain.run --help lists the flags)\n"


def test_under_torchrun_the_launch_flag_is_refused_by_rank_0_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert main(["--nproc-per-node", "2", *TINY_ARGS, "--run-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("dtrain: error: --nproc-per-node starts the ranks itself") == lines, err
