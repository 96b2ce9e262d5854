"""Launching: the SLURM batch script (with stub srun and scontrol that run every "node" on this
machine), two torchrun agents on localhost against one, the save-and-requeue on SIGUSR1, workers
that die with their agent, stop requests, and Ctrl-C."""

from __future__ import annotations

import os

from dtrain.launch import slurm
from dtrain.resilience import stop_request
from dtrain.run import main
from tests.launch import TINY_ARGS


def test_the_dry_run_prints_its_command_outside_an_allocation_too(capsys, monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    assert slurm.main(["--dry-run", "--nodes", "4", "--", "--model", "llama3-8b", "--run-dir", "runs/8b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# outside a SLURM allocation: the command for an example job of 4 nodes x 8 GPUs")
    srun = lines[1].split()
    assert srun[:2] == ["srun", "--nodes=4"] and "--gpus-per-node=8" in srun
    assert "--rdzv-endpoint=NODE0:29500" in srun and srun[-5:] == ["llama3-8b", "--run-dir", "runs/8b", "--resume",
                                                                   "auto"]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in lines


def test_a_stop_request_is_seen_by_rank_0_at_most_every_few_seconds_and_cleared(tmp_path):
    watcher, other = stop_request.StopRequest(tmp_path, enabled=True), stop_request.StopRequest(tmp_path, enabled=False)
    assert watcher.poll() is None
    stop_request.request(tmp_path, "SIGUSR1 from SLURM to job 7")
    assert watcher.poll() is None  # looked a moment ago: not again before CHECK_EVERY_S
    watcher._next_check = 0.0
    assert watcher.poll() == f"a stop request ({tmp_path / 'stop'}: SIGUSR1 from SLURM to job 7)"
    assert other.poll() is None
    other.clear()
    assert stop_request.pending(tmp_path)
    watcher.clear()
    assert not stop_request.pending(tmp_path)
    # Whatever the file holds (a gigabyte, binary), the request is its first line, cut short.
    (tmp_path / "stop").write_bytes(b"\xff\xfe preempted\n" + b"x" * 10_000_000)
    watcher._next_check = 0.0
    assert watcher.poll().endswith(": \ufffd\ufffd preempted)")


def test_the_gpus_per_node_come_from_the_job_as_slurm_writes_them(monkeypatch):
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: ["a", "b"])
    base = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "a,b"}
    for value, gpus in (("8", 8), ("h100:4", 4), ("gpu:h100:2", 2), ("", None), ("h100", None)):
        assert slurm.SlurmJob.from_environment({**base, "SLURM_GPUS_PER_NODE": value}).gpus_per_node == gpus, value
    assert slurm.SlurmJob.from_environment({**base, "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "64",
                                            "SLURM_RESTART_COUNT": "2"}) == slurm.SlurmJob("5", ("a", "b"), 2, 4, 64)


def test_ctrl_c_during_start_up_or_twice_ends_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    import dtrain.train

    def interrupted(config, before_step=None, claim=None):
        raise KeyboardInterrupt  # what the second Ctrl-C raises (the first asks for a save)

    monkeypatch.setattr(dtrain.train, "train", interrupted)
    assert main([*TINY_ARGS, "--run-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dtrain: interrupted: stopped without saving"), err
    # Not a failure of the job: nothing is recorded for a restart to judge.
    from dtrain.resilience.heartbeat import Heartbeat
    assert dtrain.train._record_failure(KeyboardInterrupt(), tmp_path, Heartbeat(0), None) is None
    assert not (tmp_path / "failures").exists()
