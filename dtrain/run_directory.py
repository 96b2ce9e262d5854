"""A new run's run directory must not hold another run: its train.log, TensorBoard event files and
checkpoints would mix with the new run's (TensorBoard overlays both curves, a later --resume takes
the other run's checkpoint). Rank 0 checks it while holding the directory's lock, before anything
is written there. Nothing here imports torch.

A run may use such a directory when it continues that run (--resume), when it is a restart of the
same job (torchrun's --max-restarts, a SLURM requeue: the logs are its own), or with --overwrite,
which deletes them first.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from dtrain.resilience import failures
from models.errors import UserError

logger = logging.getLogger("dtrain")

LOG = "train.log"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"


def previous_run(run_dir: Path) -> list[str]:
    """What of another run `run_dir` holds, in words (empty: nothing)."""
    run_dir = Path(run_dir)
    found = []
    log = run_dir / LOG
    if log.is_file() and log.stat().st_size > 0:
        found.append(LOG)
    if any((run_dir / TENSORBOARD).glob("events.out.tfevents.*")):
        found.append("TensorBoard event files")
    if any(child.name.startswith("step_") for child in _children(run_dir / CHECKPOINTS)):
        found.append("checkpoints")
    return found


def check(run_dir: Path, *, resume: str | None, overwrite: bool) -> None:
    """Rank 0, holding the run directory's lock, before the run writes there: refuses a directory
    that holds another run in one line naming --resume and --overwrite."""
    found = [] if _may_reuse(resume) else previous_run(run_dir)
    if found and not overwrite:
        raise UserError(f"--run-dir {run_dir} holds another run ({', '.join(found)}); continue it with --resume, "
                        f"delete it and start again with --overwrite, or choose another --run-dir")


def clear(run_dir: Path, *, resume: str | None, overwrite: bool) -> None:
    """Rank 0, once the run's options are checked: --overwrite deletes the previous run's log,
    event files and checkpoints."""
    found = [] if _may_reuse(resume) or not overwrite else previous_run(run_dir)
    if not found:
        return
    run_dir = Path(run_dir)
    (run_dir / LOG).unlink(missing_ok=True)
    for folder in (TENSORBOARD, CHECKPOINTS):
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    logger.info("--overwrite: deleted the previous run's %s in %s", ", ".join(found), run_dir)


def _may_reuse(resume: str | None) -> bool:
    """A run continues the directory's run (--resume), or is a restart of its job."""
    return resume is not None or failures.attempt() != (0, 0)


def _children(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []
