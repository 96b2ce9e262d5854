"""Launching: the SLURM batch script (with stub srun and scontrol that run every "node" on this
machine), two torchrun agents on localhost against one, the save-and-requeue on SIGUSR1, workers
that die with their agent, stop requests, and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.checkpoint import storage as ckpt
from dtrain.launch import slurm
from dtrain.resilience import stop_request
from models.errors import UserError
from tests.launch import REPO, TINY_ARGS, _free_port, cli_command, cli_env, scalars


SRUN = '''#!{python}
"""srun for tests: runs the command once per node of the job (all on this machine), with the
variables srun gives its tasks; records its arguments in $STUB_RECORD/srun.jsonl."""
import json, os, subprocess, sys
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
with open(os.path.join(os.environ["STUB_RECORD"], "srun.jsonl"), "a") as f:
    f.write(json.dumps({{"options": options, "command": args}}) + "\\n")
nodes = int(next(o.split("=", 1)[1] for o in options if o.startswith("--nodes=")))
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                     "SLURM_LOCALID": "0"}}) for i in range(nodes)]
codes = [task.wait() for task in tasks]
sys.exit(next((code for code in codes if code), 0))
'''


SCONTROL = '''#!/bin/bash
# scontrol for tests: `show hostnames A,B` prints one name a line; anything else is recorded.
if [ "$1" = show ] && [ "$2" = hostnames ]; then echo "$3" | tr ',' '\\n'; exit 0; fi
echo "$@" >> "$STUB_RECORD/scontrol.log"
'''


def _slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    (tmp_path / "record").mkdir(exist_ok=True)
    return cli_env({"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_RECORD": str(tmp_path / "record"),
                    "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1", "SLURM_NNODES": "2",
                    "DTRAIN_PYTHON": sys.executable, **extra})


def test_the_srun_command_starts_one_torchrun_per_node_around_a_c10d_rendezvous():
    job = slurm.SlurmJob("77", ("gpu-a", "gpu-b", "gpu-c"), requeues=0, gpus_per_node=8, cpus_per_node=96)
    torchrun = slurm.torchrun_command(job, 8, slurm.default_port(job.job_id), 3, ["--model", "llama3-8b"])
    assert torchrun[1:] == ["-m", "torch.distributed.run", "--nnodes=3", "--nproc-per-node=8", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=gpu-a:29577", "--rdzv-id=77", "--max-restarts=3", "-m", "dtrain.run",
                            "--model", "llama3-8b", "--resume", "auto"]
    assert slurm.torchrun_command(job, 8, 1, 0, ["--resume", "runs/x"])[-2:] == ["--resume", "runs/x"]
    srun = slurm.srun_command(job, Path("runs/a/logs"), torchrun)
    assert srun[:7] == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "--cpus-per-task=96", "--gpus-per-node=8"]
    assert srun[8:13] == ["-m", "dtrain.launch", "node", "--log-dir=runs/a/logs", "--"]
    env = slurm.environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, socket_ifname="ib0")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the job's own setting wins
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert slurm.split_args(["--max-restarts", "5", "--", "--steps", "3"]) == (["--max-restarts", "5"], ["--steps", "3"])
    with pytest.raises(UserError, match="not inside a SLURM allocation"):
        slurm.SlurmJob.from_environment({})


def test_outside_an_allocation_the_launcher_fails_in_one_line(tmp_path):
    env_without_slurm = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-m", "dtrain.launch", "slurm", "--", "--run-dir", str(tmp_path)],
                            cwd=REPO, env={**env_without_slurm, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("dtrain.launch: error: not inside a SLURM allocation")


@pytest.mark.slow
@pytest.mark.timeout(600)  # two start-ups of two processes
def test_two_nodes_under_the_batch_script_train_like_one_and_requeue_on_usr1(tmp_path, dp2_run):
    """The batch script on two "nodes" of one worker each (stub srun, c10d rendezvous on
    127.0.0.1). SIGUSR1 as the run starts: it saves at its first step boundary and stops, and
    the job is requeued; the requeued job (SLURM_RESTART_COUNT=1) resumes and finishes. Its
    losses are those of one torchrun agent with two workers, bit for bit."""
    run_dir = tmp_path / "run"
    port = _free_port()
    command = ["bash", str(REPO / "tools" / "slurm.sbatch"), "--nproc-per-node", "1", "--port", str(port), "--",
               *TINY_ARGS, "--run-dir", str(run_dir)]
    env = _slurm_env(tmp_path)
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    for line in launcher.stderr:  # the launcher is listening for signals once it says where the logs go
        if "logs in" in line:
            break
    launcher.send_signal(signal.SIGUSR1)
    rest = launcher.stderr.read()
    assert launcher.wait(timeout=600) == 0, rest[-3000:]
    assert "saved and stopped; requeued job 4242" in rest, rest[-3000:]
    assert (tmp_path / "record" / "scontrol.log").read_text().splitlines() == ["requeue 4242"]
    assert [step for step, _ in ckpt.valid_checkpoints(run_dir / "checkpoints")] == [1]
    assert not stop_request.pending(run_dir)  # consumed: a requeued job must not stop at once
    [call] = [json.loads(line) for line in (tmp_path / "record" / "srun.jsonl").read_text().splitlines()]
    assert {"--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"} <= set(call["options"])
    assert {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=4242", "--max-restarts=3"} <= set(call["command"]) and call["command"][-2:] == ["--resume", "auto"]
    logs = sorted((run_dir / "logs").glob("node_*.log"))
    assert [p.name for p in logs] == ["node_000.log", "node_001.log"]
    text = "".join(p.read_text() for p in logs)
    assert "received a stop request" in text and "SIGUSR1 from SLURM to job 4242" in text, text[-3000:]

    requeued = subprocess.run(command, cwd=REPO, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                              text=True, timeout=600)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert (tmp_path / "record" / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # not again
    assert scalars(run_dir)["train/loss"] == dp2_run["train/loss"]
    for log in logs:
        headers = [line for line in log.read_text().splitlines() if line.startswith("=== node")]
        assert len(headers) == 2 and "requeue 1" in headers[1], headers
    assert "resumed from" in "".join(p.read_text() for p in logs)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_workers_die_with_their_torchrun_agent(tmp_path):
    """SIGKILL the torchrun agent: its workers must not train on (and save into the run dir) as
    orphans while a scheduler restarts the job."""
    agent = subprocess.Popen(cli_command([*TINY_ARGS, "--steps", "1000", "--run-dir", str(tmp_path)], nproc=2),
                             cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    try:
        for line in agent.stdout:
            if re.search(r"step +1/1000", line):
                break
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        agent.kill()
        agent.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in workers if _alive(pid)]
        assert alive == [], f"workers {alive} outlived their agent"
    finally:
        agent.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"
