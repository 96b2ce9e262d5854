"""A training run from start to end: the process group, the run directory's lock and log file, the
trainer, and the shutdown that follows an error."""

from __future__ import annotations

from pathlib import Path

from dtrain import distributed
from dtrain.config import Config
from dtrain.metrics import log_file
from dtrain.plan.validate import validate, with_global_batch
from dtrain.resilience.run_lock import hold_run_dir
from dtrain.trainer import Trainer


def train(config: Config, before_step=None) -> list[dict[str, float]]:
    """Runs the configured training; returns every step's scalars (the loss on every rank)."""
    config = with_global_batch(config, distributed.world_size_from_env())
    validate(config, distributed.world_size_from_env())
    runtime = distributed.init_process_group()
    run_dir = Path(config.train.run_dir)
    try:
        # The lock first: a second run in this directory stops before it writes anything there.
        with hold_run_dir(run_dir, runtime.rank, runtime.world_size), log_file(run_dir / "train.log", runtime.is_main):
            scalars = Trainer(config, runtime).fit(before_step)
    except BaseException:
        distributed.shutdown(after_error=True)
        raise
    distributed.shutdown()
    return scalars
