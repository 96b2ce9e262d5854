"""Process-group set-up: under torchrun (one process per GPU, or several CPU processes on gloo),
as one plain process, or as a fake world for printing the plan of a large mesh on a laptop; the
collective timeout (long while a run starts, short once steps run) and NCCL's flight recorder."""

from __future__ import annotations

import datetime
import gc
import logging
import os
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("dtrain")

FLIGHT_RECORDER = "flight_recorder"  # under the run directory: NCCL's dumps on a collective timeout
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives kept per rank (TorchTitan's default)


@attrs.frozen
class Runtime:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(timeout_s: float = 600.0, run_dir: Path | None = None) -> Runtime:
    """The default process group for this run: NCCL for CUDA tensors (gloo beside it for CPU
    tensors), gloo on a machine without GPUs. `timeout_s` bounds every collective until
    `set_collective_timeout` changes it; with `run_dir`, NCCL dumps its flight recorder there."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
        if run_dir is not None:
            enable_flight_recorder(Path(run_dir))
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if launched_by_torchrun():
        device_id = device if device.type == "cuda" else None
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), device)


def _attempt_store(timeout: datetime.timedelta):
    """The agent's store under a prefix of its own for this restart of the workers, or None for
    torch's own choice. torchrun's workers share its agent's TCPStore across restarts with the
    same keys, so a restarted rank may read the previous attempt's gloo or NCCL addresses and fail
    to connect (pytorch/pytorch#135712, #167288; seen here with --max-restarts on gloo). The
    restart count is the same on every worker of one agent; agents of several nodes may count
    differently, so a multi-node job must not share the agent's store at all: set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the SLURM launcher does), and rank 0 then hosts a new
    store for each attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0 and os.environ.get("RANK") == "0":
            logger.warning("--max-restarts with several nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
                           "torchrun, or a restarted rank may connect to the previous attempt's addresses")
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"dtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def enable_flight_recorder(run_dir: Path) -> None:
    """NCCL keeps its last collectives per rank and, when one times out, writes them to
    RUN_DIR/flight_recorder/rank_N (`torchfrtrace RUN_DIR/flight_recorder` reads them). Read by the
    NCCL process group when it is created, so this runs first; values the user set win. Each
    variable under its older TORCH_NCCL_ and its newer TORCH_FR_ name."""
    folder = run_dir / FLIGHT_RECORDER
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES),
                        ("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{folder}/rank_"),
                        ("TORCH_FR_DUMP_TEMP_FILE", f"{folder}/rank_")):
        os.environ.setdefault(name, value)


def dump_flight_recorder(rank: int) -> Path | None:
    """Writes this rank's NCCL flight recorder now, where NCCL writes it on a timeout (a hang found
    before any collective timed out ends the run without one); None without NCCL or the API."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if not (prefix and dump and torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    path = Path(f"{prefix}{rank}")
    path.write_bytes(dump())
    return path


def process_groups() -> list:
    """Every process group this rank belongs to, the default one included."""
    return list(c10d._world.pg_map)


def set_collective_timeout(timeout_s: float, groups: list) -> None:
    """Collectives of `groups` issued from now on time out after `timeout_s`. gloo applies it to
    each later collective (verified on CPU); NCCL to each collective enqueued later (its watchdog
    compares a collective's own timeout, taken when it is enqueued)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in groups:
        c10d._set_pg_timeout(timeout, group)


def init_fake_process_group(world_size: int, rank: int = 0) -> Runtime:
    """A world of `world_size` ranks in this one process, seen from `rank`; no collective runs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return Runtime(rank, world_size, torch.device("cpu"))


def _release_groups() -> None:
    """Lets the groups die with destroy_process_group, not at interpreter exit. A device mesh holds
    its process groups, and torch's DTensor caches (sharding propagation, mesh topology) keep the
    meshes of a finished run; the groups then lived until the interpreter finalized, where a gloo
    worker releasing its last work takes the GIL of an interpreter being torn down and aborts a run
    that succeeded ("terminate called without an active exception"). The run's own objects that
    only cycles keep go first; a mesh resolves its groups by name outside torch.compile."""
    gc.collect()
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()


def shutdown(after_error: bool = False) -> None:
    """Ends the process group. After an error on GPUs it is aborted instead: the other ranks may be
    waiting in a collective that this rank will never join, and destroying the group would wait for
    them (NCCL), hiding the error behind a hang. Aborted, this process exits with its error and
    torchrun stops the others. (gloo's destroy does not wait; its peers see the connection close.)"""
    if not dist.is_initialized():
        return
    _release_groups()
    if after_error and dist.get_world_size() > 1 and torch.cuda.is_available() and dist.is_nccl_available():
        dist.distributed_c10d._abort_process_group()
        return
    dist.destroy_process_group()
