"""The last lines of a run: what it did, where its checkpoint, TensorBoard files and log are, and
the commands that come next (continue it, export it to Hugging Face, read its curves)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from dtrain.launch import local


def launcher(world_size: int) -> str:
    """How to start this run again, as the start of a command line: plain Python for one process,
    dtrain's own launcher for the processes of one node; several nodes keep their own launcher."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node == world_size:
        return local.command(world_size)
    return "<this job's launcher> -m dtrain.run"


def closing_lines(*, run_dir: Path, step: int, total_steps: int, checkpoint: Path | None, world_size: int,
                  elapsed_s: float, last_loss: float | None, overwrite: bool = False) -> list[str]:
    """Rank 0's last log lines. `checkpoint`: the run directory's checkpoint of `step`, if saved;
    `overwrite`: this run's --overwrite, which its config.toml keeps and a resume must not."""
    q = lambda path: shlex.quote(str(path))  # noqa: E731
    loss = f"; loss {last_loss:.4f}" if last_loss is not None else ""
    ended = "finished" if step >= total_steps else f"stopped at step {step} of {total_steps}"
    lines = [f"run {ended} after {elapsed_s:.1f} s{loss}",
             f"  checkpoint:  {checkpoint if checkpoint is not None else 'none saved at this step'}",
             f"  TensorBoard: {run_dir / 'tensorboard'}",
             f"  log:         {run_dir / 'train.log'}",
             "next:"]
    if checkpoint is not None:
        more = (" --no-overwrite" if overwrite else "") + (f" --steps {2 * total_steps}" if step >= total_steps else "")
        lines.append(f"  continue:    {launcher(world_size)} --config {q(run_dir / 'config.toml')} --resume{more}")
        lines.append(f"  export:      python -m tools.hf_convert export {q(run_dir)} {q(run_dir / 'hf')}")
    lines.append(f"  curves:      tensorboard --logdir {q(run_dir / 'tensorboard')}")
    return lines
