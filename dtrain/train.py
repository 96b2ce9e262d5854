"""A training run from start to end: the process group, the run's log file, the trainer, and the
shutdown that follows an error."""

from __future__ import annotations

from pathlib import Path

import torch

from dtrain import distributed
from dtrain.config import Config
from dtrain.metrics import log_file
from dtrain.plan import advice
from dtrain.plan.validate import validate, with_global_batch
from dtrain.trainer import Trainer
from models.errors import UserError


def train(config: Config, before_step=None) -> list[dict[str, float]]:
    """Runs the configured training; returns every step's scalars (the loss on every rank). A CUDA
    out-of-memory error becomes a report of this rank's predicted memory and the nearest layout
    the planner says fits."""
    world_size = distributed.world_size_from_env()
    if config.parallel.mesh == "auto":
        config = advice.choose(config, world_size)
    config = with_global_batch(config, world_size)
    validate(config, world_size)
    runtime = distributed.init_process_group()
    try:
        with log_file(Path(config.train.run_dir) / "train.log", runtime.is_main):
            scalars = Trainer(config, runtime).fit(before_step)
    except torch.OutOfMemoryError as error:
        distributed.shutdown(after_error=True)
        raise UserError(advice.out_of_memory_report(config, world_size, runtime.rank, error)) from None
    except BaseException:
        distributed.shutdown(after_error=True)
        raise
    distributed.shutdown()
    return scalars
