"""Automatic restarts under torchrun --max-restarts: a rank killed mid-run restarts every rank from
the latest checkpoint with the losses of an uninterrupted run, bit for bit; a failure that comes
back at the same step stops the job instead of spending its restarts."""

from __future__ import annotations

import os

import pytest

from dtrain.resilience import failures
from dtrain.run import main
from dtrain.resilience.failures import Failure
from models.errors import UserError
from tests.launch import TINY_ARGS


def _failure(attempt, step=5, kind="lost", key="lost: rank 1 exited", rank=0, at=0.0) -> Failure:
    return Failure(rank, step, "forward", kind, f"rank {rank} failed", key, attempt=attempt, time=at)


def test_the_cause_of_an_attempt_and_when_two_attempts_failed_alike():
    # A rank's own error outranks the lost peers the others saw, whatever was written first.
    oom = _failure((0, 1), kind="error", key="OutOfMemoryError: CUDA out of memory", rank=1, at=2.0)
    assert failures.cause([_failure((0, 1), at=1.0), oom]) == oom
    first = [_failure((0, 0)), _failure((0, 0), kind="error", key="ValueError: bad sample #", rank=1)]
    again = [_failure((0, 1)), _failure((0, 1), kind="error", key="ValueError: bad sample #", rank=1)]
    assert failures.repeated(first + again) is not None
    assert failures.repeated(first) is None  # one attempt is no repetition
    assert failures.repeated(first + [_failure((0, 1), step=6)]) is None  # another step: progress was made
    assert failures.repeated(first + [_failure((0, 1), kind="hang", key="stopped rank 1 at data")]) is None
    # Only the last two attempts count: a job that got past a failure is judged afresh.
    assert failures.repeated(first + [_failure((0, 1), step=9)] + [_failure((1, 0), step=9)]) is not None


def test_errors_are_classified_without_their_volatile_numbers():
    lost = failures.from_error(RuntimeError("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:6421"), 0, 5,
                               "forward")
    assert lost.kind == "lost" and lost.key == "lost: RuntimeError: [gloo/pair.cc:#] Connection closed by peer [#.#.#.#]:#"
    named = failures.from_error(RuntimeError("Connection closed by peer"), 0, 5, "forward",
                                lost=("rank 1 (pid 77, last heard of in step 5, data) exited", "rank 1 exited"))
    assert named.key == "lost: rank 1 exited" and named.what.endswith("lost its peers: rank 1 (pid 77, last "
                                                                      "heard of in step 5, data) exited")
    oom = failures.from_error(MemoryError("tried to allocate 2.50 GiB on rank 3"), 3, 7, "backward")
    assert (oom.kind, oom.key) == ("error", "MemoryError: tried to allocate #.# GiB on rank #")
    assert failures.from_error(failures.Terminated("SIGTERM"), 0, 3, "init").kind == "lost"
    # Words of a communication error inside other words, or in a refused input's message, are none.
    assert failures.from_error(RuntimeError("TypeError: list indices must be integers"), 0, 0, "init").kind == "error"
    refused = failures.from_error(UserError("--data-cache-dir /peer/socket timed out: choose another"), 0, 0, "init")
    assert refused.kind == "error" and refused.what == "rank 0 at step 0 (init): --data-cache-dir /peer/socket timed " \
                                                      "out: choose another", refused


def test_a_refused_input_whose_words_sound_like_a_lost_peer_is_said_as_it_is(tmp_path, capsys):
    """A refusal that names a path with 'peer' in it was reported as 'rank 0 lost its peers' (exit
    code 1), and so was one that named a TypeError."""
    empty = tmp_path / "peer"
    empty.mkdir()
    code = main([*TINY_ARGS, "--steps", "1", "--run-dir", str(tmp_path / "run"), "--resume", str(empty)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"dtrain: error: --resume {empty}: holds no complete checkpoint"), err


def test_unreadable_records_are_skipped_not_fatal(tmp_path):
    failures.record(tmp_path, _failure((0, 0)))
    with open(tmp_path / "failures" / "rank_00001.jsonl", "w") as f:
        f.write('{"rank": 1, "step": "x"}\n{"attempt": "zz", "kind": "error"}\n\x00\xff garbage\n{"half": ')
    assert [f.rank for f in failures.read(tmp_path)] == [0]


def test_a_fresh_start_sets_the_record_aside_and_a_restart_after_two_alike_stops(tmp_path, monkeypatch):
    for attempt in ((0, 0), (0, 1)):
        failures.record(tmp_path, _failure(attempt))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with pytest.raises(failures.JobFailure, match=r"failed the same way in two attempts in a row, at step 5: "
                                                  r"rank 0 failed; another restart would fail again") as info:
        failures.check_start(tmp_path)
    assert "\n" not in str(info.value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # a person starts the job again: a new record
    failures.check_start(tmp_path)
    assert failures.read(tmp_path) == []
    assert sorted(p.name for p in (tmp_path / "failures.previous").iterdir()) == ["rank_00000.jsonl"]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job is a restart too
    failures.check_start(tmp_path)  # nothing recorded since the fresh start


def test_torchruns_sigterm_during_the_record_of_a_lost_peer_does_not_cut_the_record_short(tmp_path, monkeypatch):
    """torchrun sends SIGTERM a fraction of a second after a worker dies: to the survivors while
    they write down their lost peer. Found on a loaded machine: no record of rank 0, so a restart
    could not tell a repeated failure."""
    import signal

    import dtrain.train
    from tests.layouts import resolved

    class PeerGone:
        def __init__(self, *args, **kwargs):
            pass

        def fit(self, before_step=None):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:6421")

    write = failures.record

    def record_as_sigterm_arrives(run_dir, failure):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(run_dir, failure)

    monkeypatch.setattr(dtrain.train, "Trainer", PeerGone)
    monkeypatch.setattr(failures, "record", record_as_sigterm_arrives)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(failures.JobFailure, match="lost its peers"):
        dtrain.train.train(resolved([*TINY_ARGS, "--run-dir", str(tmp_path)]))
    assert signal.getsignal(signal.SIGTERM) is handler
    [recorded] = failures.read(tmp_path)
    assert (recorded.kind, recorded.rank) == ("lost", 0)
