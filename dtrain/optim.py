"""AdamW over the (sharded) parameters with weight-decay groups, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from dtrain.config import OptimArgs


def build_optimizer(model_parts: list[nn.Module], args: OptimArgs, fused: bool | None = None) -> torch.optim.AdamW:
    """Weight decay on matmul weights only; norms and embeddings are left undecayed. Each part
    (the model, or this rank's pipeline stages) has `specs`: parameter name -> ParamSpec.
    `fused`: the fused kernel (default: where the parameters are on a GPU), else foreach."""
    decay, no_decay = [], []
    for part in model_parts:
        for name, param in part.named_parameters():
            if param.requires_grad:
                (decay if part.specs[name].weight_decay else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if fused is None:
        # The fused kernel runs the whole update in a few launches on GPU; foreach elsewhere.
        fused = next(model_parts[0].parameters()).device.type == "cuda"
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
        fused=fused, foreach=not fused,
    )


def lr_multiplier(step: int, total_steps: int, args: OptimArgs) -> float:
    """Multiplier of the peak LR for the update of `step` (0-based): linear warm-up, then decay
    to `min_lr_ratio` by `args.decay` (cosine, linear, constant, or wsd = warmup-stable-decay)."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    # The last update (step total_steps - 1) runs at the minimum.
    decay_steps = max(total_steps - 1 - args.warmup_steps, 1)
    progress = min((step - args.warmup_steps) / decay_steps, 1.0)
    low = args.min_lr_ratio
    if args.decay == "constant":
        return 1.0
    if args.decay == "linear":
        return 1.0 - (1.0 - low) * progress
    if args.decay == "cosine":
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if args.decay == "wsd":
        stable = 1.0 - args.decay_fraction
        if progress <= stable:
            return 1.0
        return 1.0 - (1.0 - low) * (progress - stable) / max(args.decay_fraction, 1e-12)
    raise ValueError(f"unknown decay {args.decay!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, args: OptimArgs):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, args))
