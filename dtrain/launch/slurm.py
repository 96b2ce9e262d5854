"""Multi-node training under SLURM: one torchrun per node, rendezvous on the first node, one log
per node in the run directory, and a save and requeue when SLURM announces the end of the time.

    sbatch --nodes 8 --gpus-per-node 8 tools/slurm.sbatch --model llama3-8b --run-dir runs/8b
    python -m dtrain.launch slurm [--max-restarts 3] [--socket-ifname ib0] -- --model llama3-8b ...

Run inside the allocation (tools/slurm.sbatch execs it, so that it is the process SLURM signals):

1. the nodes come from `scontrol show hostnames $SLURM_JOB_NODELIST`; the first hosts torchrun's
   c10d rendezvous on a port derived from the job id (--port);
2. `srun` starts on every node `python -m dtrain.launch node`, which appends to
   RUN_DIR/logs/node_NNN.log and becomes `torchrun --nnodes N --nproc-per-node G --rdzv-backend
   c10d --rdzv-endpoint HEAD:PORT --rdzv-id $SLURM_JOB_ID --max-restarts R -m dtrain.run ARGS
   --resume auto`: a rank that dies restarts the workers of every node from the latest checkpoint
   (the job's first start, with none yet, at step 0; checkpoints that are all corrupt stop it);
3. on SIGUSR1 (`#SBATCH --signal=B:USR1@120`: the time limit is 120 s away) it asks the run to
   save and stop (RUN_DIR/stop, see dtrain.resilience.stop_request), waits for it, and requeues
   the job (`scontrol requeue $SLURM_JOB_ID`), which resumes from that checkpoint. A SIGTERM
   (preemption, or scancel) reaches the workers too: they save at their next step boundary; the
   job is requeued only with --requeue-on-sigterm, since scancel sends the same signal.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import attrs

from dtrain.launch import node
from dtrain.resilience import stop_request
from models.errors import UserError

# What every node's torchrun and workers see (values already set in the job's environment win).
ENVIRONMENT = {
    # Workers of each restart get a new TCPStore for their process group: sharing torchrun's own
    # across restarts lets a restarted rank read the last attempt's addresses (pytorch#135712).
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    # A failed or timed-out NCCL collective ends the process (no cleanup that could hang):
    # torchrun then restarts the workers.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "PYTHONUNBUFFERED": "1",  # node logs as it happens
    "PYTHONFAULTHANDLER": "1",  # a crash in native code still prints the Python stacks
}


@attrs.frozen
class SlurmJob:
    job_id: str
    nodes: tuple[str, ...]
    requeues: int  # SLURM_RESTART_COUNT
    gpus_per_node: int | None
    cpus_per_node: int | None

    @classmethod
    def from_environment(cls, env: dict[str, str]) -> "SlurmJob":
        if not env.get("SLURM_JOB_ID") or not env.get("SLURM_JOB_NODELIST"):
            raise UserError("not inside a SLURM allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST): submit it with "
                            "`sbatch --nodes N tools/slurm.sbatch TRAIN ARGS`")
        nodes = hostnames(env["SLURM_JOB_NODELIST"])
        # SLURM_GPUS_PER_NODE is what was asked for: `8`, `h100:8`, `gpu:h100:8`.
        gpus = (env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE", "")).rsplit(":", 1)[-1]
        gpus_per_node = int(gpus) if gpus.isdigit() else None
        cpus = env.get("SLURM_CPUS_ON_NODE", "")
        return cls(env["SLURM_JOB_ID"], tuple(nodes), int(env.get("SLURM_RESTART_COUNT") or 0), gpus_per_node,
                   int(cpus) if cpus.isdigit() else None)


def example_job(nodes: int, gpus_per_node: int) -> SlurmJob:
    """What `--dry-run` shows outside an allocation: a job of `nodes` placeholder nodes."""
    return SlurmJob("$SLURM_JOB_ID", tuple(f"NODE{i}" for i in range(nodes)), 0, gpus_per_node, None)


def hostnames(nodelist: str) -> list[str]:
    """SLURM's compact node list (`gpu[001-004,010]`) expanded by scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise UserError(f"`scontrol show hostnames {nodelist}` failed ({error}); run this inside a SLURM job") from None
    names = out.split()
    if not names:
        raise UserError(f"`scontrol show hostnames {nodelist}` named no node")
    return names


def default_port(job_id: str) -> int:
    """A port per job, so that two jobs sharing a first node do not collide: 29500-30499."""
    return 29500 + int(re.sub(r"\D", "", job_id) or 0) % 1000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dtrain.launch slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [OPTIONS] -- TRAIN ARGS (the flags of python -m dtrain.run)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="workers per node (default: the job's GPUs per node)")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="times torchrun restarts the workers of every node after a rank fails")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port on the first node (default: "
                                                               "29500 + job id mod 1000)")
    parser.add_argument("--socket-ifname", default=None,
                        help="network interface for NCCL's and gloo's sockets (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)")
    parser.add_argument("--requeue-on-sigterm", action="store_true",
                        help="requeue after a SIGTERM too (clusters that preempt by cancelling; scancel then requeues)")
    parser.add_argument("--dry-run", action="store_true", help="print the srun command and environment, run nothing "
                                                                "(outside an allocation: for an example job)")
    parser.add_argument("--nodes", type=int, default=2,
                        help="--dry-run outside an allocation: the nodes of the example job (inside one: the job's)")
    return parser


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, training args): split at `--`; without one, everything is for training
    but a lone --help."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return (argv, []) if argv in (["-h"], ["--help"]) else ([], argv)


def torchrun_command(job: SlurmJob, nproc: int, port: int, max_restarts: int, train_args: list[str]) -> list[str]:
    if not any(arg == "--resume" or arg.startswith("--resume=") for arg in train_args):
        # A restart, or a requeued job, continues where it stopped; the first start begins at step 0.
        train_args = [*train_args, "--resume", "auto"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(job.nodes)}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={job.nodes[0]}:{port}",
            f"--rdzv-id={job.job_id}", f"--max-restarts={max_restarts}", "-m", "dtrain.run", *train_args]


def srun_command(job: SlurmJob, log_dir: Path, torchrun: list[str]) -> list[str]:
    """One task per node (options as --name=value: nothing after them is srun's)."""
    options = [f"--nodes={len(job.nodes)}", f"--ntasks={len(job.nodes)}", "--ntasks-per-node=1",
               "--kill-on-bad-exit=1"]
    if job.cpus_per_node:
        options.append(f"--cpus-per-task={job.cpus_per_node}")  # else srun binds the task to one CPU
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    return ["srun", *options, sys.executable, "-m", "dtrain.launch", "node", f"--log-dir={log_dir}", "--", *torchrun]


def environment(base: dict[str, str], socket_ifname: str | None) -> dict[str, str]:
    env = {**ENVIRONMENT, **base}
    if socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = socket_ifname
    return env


class Signals:
    """SIGUSR1 (and SIGTERM) while the job runs: ask the run to save and stop; remember to requeue."""

    def __init__(self, run_dir: Path, job: SlurmJob, requeue_on_sigterm: bool):
        self.run_dir, self.job, self.requeue_on_sigterm = run_dir, job, requeue_on_sigterm
        self.requeue = False
        signal.signal(signal.SIGUSR1, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        stop_request.request(self.run_dir, f"{name} from SLURM to job {self.job.job_id}")
        self.requeue = self.requeue or signum == signal.SIGUSR1 or self.requeue_on_sigterm
        _say(f"{name}: asked the run to save and stop ({self.run_dir / stop_request.STOP})"
             f"{'; the job will be requeued' if self.requeue else ''}")


def _say(message: str) -> None:
    print(f"dtrain.launch: {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    from dtrain.config import load_config

    own, train_args = split_args(argv)
    options = build_parser().parse_args(own)
    try:
        run_dir = Path(load_config(train_args).train.run_dir)  # also checks the training flags now
        inside = bool(os.environ.get("SLURM_JOB_ID"))
        if options.dry_run and not inside:
            job = example_job(options.nodes, options.nproc_per_node or 8)
            print(f"# outside a SLURM allocation: the command for an example job of {options.nodes} nodes x "
                  f"{job.gpus_per_node} GPUs (NODE0 ... stand for its hosts); sbatch tools/slurm.sbatch runs it")
        else:
            job = SlurmJob.from_environment(dict(os.environ))
        nproc = options.nproc_per_node or job.gpus_per_node
        if not nproc or nproc < 1:
            raise UserError("the job has no GPUs per node in its environment: pass --nproc-per-node N (N >= 1)")
        if options.nodes < 1:
            raise UserError(f"--nodes {options.nodes} must be >= 1")
        if options.max_restarts < 0:
            raise UserError(f"--max-restarts {options.max_restarts} must be >= 0")
    except UserError as error:
        print(f"dtrain.launch: error: {error}", file=sys.stderr)
        return 2
    port = options.port or default_port(job.job_id)  # 29500 for the example job
    log_dir = run_dir / "logs"
    command = srun_command(job, log_dir, torchrun_command(job, nproc, port, options.max_restarts, train_args))
    env = environment(dict(os.environ), options.socket_ifname)
    if options.dry_run:
        print(" ".join(command))
        for key in sorted(set(env) - set(os.environ)):
            print(f"{key}={env[key]}")
        return 0
    Path(run_dir / stop_request.STOP).unlink(missing_ok=True)  # a request left by an earlier job
    signals = Signals(run_dir, job, options.requeue_on_sigterm)
    _say(f"job {job.job_id}: {len(job.nodes)} nodes x {nproc} workers, rendezvous on {job.nodes[0]}:{port}, "
         f"logs in {log_dir}/node_*.log")
    code = subprocess.run(command, env=env).returncode
    if signals.requeue and not stop_request.pending(run_dir):  # the run saved for the request and stopped
        subprocess.run(["scontrol", "requeue", job.job_id], check=False)
        _say(f"saved and stopped; requeued job {job.job_id}")
        return 0
    Path(run_dir / stop_request.STOP).unlink(missing_ok=True)
    if code != 0:
        _say(f"srun exited with {code}; see {node.log_path(log_dir, 0).parent}/node_*.log")
    return code
