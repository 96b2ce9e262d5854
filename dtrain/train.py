"""A training run from start to end: the process group, the run's log file, the trainer, and the
shutdown that follows an error."""

from __future__ import annotations

from pathlib import Path

from dtrain import distributed
from dtrain.config import Config
from dtrain.metrics import log_file
from dtrain.plan.validate import validate, with_global_batch
from dtrain.trainer import Trainer
from models.errors import UserError


def train(config: Config, before_step=None) -> list[dict[str, float]]:
    """Runs the configured training; returns every step's scalars (the loss on every rank)."""
    world_size = distributed.world_size_from_env()
    planned = config.parallel.world_size
    if planned is not None and planned != world_size:
        raise UserError(f"--world-size {planned} is for --dry-run and --print-plan; this run has {world_size} "
                        f"process(es): drop --world-size or start {planned}")
    if config.parallel.dry_run_rank is not None:
        raise UserError("--dry-run-rank needs --dry-run")
    config = with_global_batch(config, world_size)
    validate(config, world_size)
    runtime = distributed.init_process_group()
    try:
        with log_file(Path(config.train.run_dir) / "train.log", runtime.is_main):
            scalars = Trainer(config, runtime).fit(before_step)
    except BaseException:
        distributed.shutdown(after_error=True)
        raise
    distributed.shutdown()
    return scalars
