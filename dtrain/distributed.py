"""Process-group set-up: under torchrun (one process per GPU, or several CPU processes on gloo),
as one plain process, or as a fake world for printing the plan of a large mesh on a laptop."""

from __future__ import annotations

import datetime
import os

import attrs
import torch
import torch.distributed as dist


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


def init_process_group() -> Runtime:
    """The default process group for this run: NCCL for CUDA tensors (gloo beside it for CPU
    tensors), gloo on a machine without GPUs."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(minutes=10)
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), device)


def init_fake_process_group(world_size: int, rank: int = 0) -> Runtime:
    """A world of `world_size` ranks in this one process, seen from `rank`; no collective runs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return Runtime(rank, world_size, torch.device("cpu"))


def shutdown(after_error: bool = False) -> None:
    """Ends the process group. After an error on GPUs it is aborted instead: the other ranks may be
    waiting in a collective that this rank will never join, and destroying the group would wait for
    them (NCCL), hiding the error behind a hang. Aborted, this process exits with its error and
    torchrun stops the others. (gloo's destroy does not wait; its peers see the connection close.)"""
    if not dist.is_initialized():
        return
    if after_error and dist.get_world_size() > 1 and torch.cuda.is_available() and dist.is_nccl_available():
        dist.distributed_c10d._abort_process_group()
        return
    dist.destroy_process_group()
