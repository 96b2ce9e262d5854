"""What a resumed run takes from its checkpoint and what it takes from its own flags.

The weights, AdamW's moments, the step, the LR schedule's position, the data position (samples
consumed) and the skipped steps come from the checkpoint. The hyperparameters come from the
flags: a resumed run with a new `--lr` (or betas, eps, weight decay, schedule) uses it from its
first step, and the log names every setting that differs from the checkpoint's run. A new
`--global-batch` continues the data stream at the sample where the checkpoint stopped.
"""

from __future__ import annotations

import tomllib
from typing import Any

import attrs
import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.checkpoint.storage import CorruptCheckpoint
from models.errors import UserError

# Settings whose change is the point of resuming, not news.
_NOT_REPORTED = {"train.resume", "train.start_over", "train.run_dir", "train.init_from_hf"}


@attrs.frozen
class Resumed:
    """Where a run starts: step 0 with an empty `meta`, or a checkpoint's step and meta.json."""

    step: int = 0
    consumed_samples: int = 0
    meta: dict[str, Any] = attrs.field(factory=dict)


def saved_config(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The resolved config of the checkpoint's run ({} for an imported checkpoint)."""
    try:
        return tomllib.loads(meta.get("config") or "")
    except tomllib.TOMLDecodeError:
        return {}


def consumed_samples(meta: dict[str, Any], global_batch: int) -> int:
    """The samples the checkpoint's run consumed: stored since format 2, step x its global batch before."""
    if "consumed_samples" in meta:
        return int(meta["consumed_samples"])
    saved = saved_config(meta).get("data", {}).get("global_batch", global_batch)
    return int(meta["step"]) * int(saved)


def changed_settings(meta: dict[str, Any], config: Config) -> list[str]:
    """`group.key old -> new` for every flag whose value differs from the checkpoint's run."""
    saved = saved_config(meta)
    if not saved:
        return []
    # A key the saved config lacks was unset (None) there, or did not exist yet: its default then.
    defaults = Config().to_dict()
    changes = []
    for group, values in config.to_dict().items():
        for key, value in values.items():
            name = f"{group}.{key}"
            before = saved.get(group, {}).get(key, defaults[group][key])
            if name not in _NOT_REPORTED and before != value:
                changes.append(f"{name} {before} -> {value}")
    return changes


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings (all but its parameters), to put back after a load."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, configured: list[dict[str, Any]]) -> None:
    """After loading a checkpoint's optimizer and scheduler state: this run's settings replace the
    saved ones (the state dict carries the old run's lr, betas, fused flag ...), and the LR becomes
    this run's peak LR times the schedule at the saved step, computed as LambdaLR computes it."""
    for group, ours in zip(optimizer.param_groups, configured):
        group.update(ours)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports; LambdaLR's load_state_dict sets it the same way


def agree(error: UserError | None) -> None:
    """Every rank's outcome of checking a checkpoint, made one: raises on every rank the first
    refusal (another model ...) if any rank has one, else the first corruption found, else returns.
    A rank that saw nothing wrong must not load while another found its share of files damaged."""
    outcome = None if error is None else (isinstance(error, CorruptCheckpoint), str(error))
    outcomes = [outcome]
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
    found = [o for o in outcomes if o is not None]
    for corrupt, message in sorted(found, key=lambda o: o[0]):  # refusals first
        raise (CorruptCheckpoint if corrupt else UserError)(message, every_rank=True)
