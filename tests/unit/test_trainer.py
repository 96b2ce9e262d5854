"""The training loop reads a step's loss back only after queuing the next step: the scalars,
evaluations and checkpoints must be those of reading every step back at once."""

from __future__ import annotations

from dtrain import distributed
from dtrain.resilience import failures
from dtrain.trainer import Trainer
from tests.launch import TINY_ARGS
from tests.layouts import resolved


def _fit(run_dir, data: str, overlap: bool) -> list[dict[str, float]]:
    layout = resolved([*TINY_ARGS, "--run-dir", str(run_dir), "--data", data, "--split", "90,10,0",
                       "--eval-every", "4", "--eval-steps", "2", "--checkpoint-every", "3"])
    runtime = distributed.init_process_group()
    try:
        trainer = Trainer(layout, runtime)
        trainer.overlap_read_back = overlap
        return trainer.fit()
    finally:
        distributed.shutdown()


def test_a_failing_run_aborts_its_gpu_process_group_instead_of_waiting_for_the_others(monkeypatch, tmp_path):
    """On NCCL, destroying the group after an error waits for ranks blocked in a collective that the
    failed rank will never join: the run hangs and its error is never printed. It must abort."""
    from dtrain import train as train_lib

    calls = []
    dist = distributed.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    distributed.shutdown(after_error=True)
    distributed.shutdown()
    assert calls == ["abort", "destroy"]

    # train() takes the error path when the training loop raises, and the error reaches the caller.
    ended = []
    monkeypatch.setattr(train_lib.distributed, "init_process_group",
                        lambda *args, **kwargs: distributed.Runtime(0, 1, distributed.torch.device("cpu")))
    monkeypatch.setattr(train_lib.distributed, "shutdown", lambda after_error=False: ended.append(after_error))

    def failing_trainer(layout, runtime, **kwargs):
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(train_lib, "Trainer", failing_trainer)  # the name train() calls
    layout = resolved([*TINY_ARGS, "--run-dir", str(tmp_path), "--step-timeout", "0"])
    try:
        train_lib.train(layout)
    except RuntimeError as error:
        assert str(error) == "a rank failed"
    else:
        raise AssertionError("train() swallowed the error")
    assert ended == [True]
    # The failure is recorded for the next start to judge.
    assert [f.key for f in failures.read(tmp_path)] == ["RuntimeError: a rank failed"]
