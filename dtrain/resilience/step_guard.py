"""Skipping the update of a bad step: a non-finite loss or gradient norm, or (opt-in) a loss spike.

    guard = StepGuard(max_skipped_steps=5, spike_factor=3.0, spike_window=32, global_tokens=..., device=...)
    skip = guard.decide(loss_sum, grad_norm)    # on the device, before the optimizer step
    optimizer.found_inf = skip.found_inf        # the fused AdamW leaves weights and state as they were
    ...one step later, on the host...
    guard.record(step, skipped, loss, grad_norm, median)   # counts; raises after too many in a row

The decision is taken on the device from tensors that are identical on every rank: the global
gradient norm (all-reduced over every dim that splits gradients) and the loss summed over every
rank, so every rank skips the same steps without a host sync and without a further collective.
A spike is a loss above `spike_factor` x the median loss of the last `spike_window` updated
steps, kept in a small device buffer; skipped steps do not enter it. The buffer and the list of
skipped steps are part of the checkpoint, so a resumed run decides exactly as the uninterrupted
one would.
"""

from __future__ import annotations

import logging
import math

import attrs
import torch

from models.errors import UserError

logger = logging.getLogger("dtrain")


@attrs.frozen
class Decision:
    """A step's skip decision, on the device: `found_inf` (1.0 to skip, 0.0 to update) as the fused
    optimizers take it, and `median`, the spike detector's median loss (NaN until it has a window)."""

    found_inf: torch.Tensor
    median: torch.Tensor


class StepGuard:
    def __init__(self, *, max_skipped_steps: int, spike_factor: float, spike_window: int, global_tokens: int,
                 device: torch.device, is_main: bool = True):
        self.max_skipped_steps, self.spike_factor = max_skipped_steps, spike_factor
        self.global_tokens, self.is_main = global_tokens, is_main
        # The losses of the last updated steps, oldest first; valid once `num_recent` reaches the window.
        self.recent = torch.zeros(spike_window, dtype=torch.float32, device=device)
        self.num_recent = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_steps: list[int] = []
        self.in_a_row = 0

    @property
    def window(self) -> int:
        return self.recent.numel()

    @torch.no_grad()
    def decide(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> Decision:
        """Queued on the device; reads nothing back."""
        loss = loss_sum.float() / self.global_tokens
        skip = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        median = torch.full_like(loss, math.nan)
        if self.spike_factor > 0:
            full = self.num_recent >= self.window
            median = torch.where(full, self.recent.median(), median)
            skip = skip | (loss > self.spike_factor * median)  # False while the median is NaN
            keep = ~skip
            shifted = torch.cat([self.recent[1:], loss.reshape(1)])
            self.recent.copy_(torch.where(keep, shifted, self.recent))
            self.num_recent.copy_(torch.clamp(self.num_recent + keep.long(), max=self.window))
        return Decision(skip.float(), median)

    def record(self, step: int, skipped: bool, loss: float, grad_norm: float, median: float) -> str | None:
        """The host's account of a step read back: logs a skip, and stops the run with a one-line
        error once `max_skipped_steps` steps in a row were skipped (every rank raises the same).
        Returns why the step was skipped ("non-finite" or "spike"), None where it was not."""
        if not skipped:
            self.in_a_row = 0
            return None
        self.skipped_steps.append(step)
        self.in_a_row += 1
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite:
            reason = f"loss {loss:.4g}, gradient norm {grad_norm:.4g}"
        else:
            reason = f"loss spike: {loss:.4f} > {self.spike_factor:g} x median {median:.4f}"
        if self.is_main:
            logger.warning("step %d: update skipped (%s); %d skipped in a row, %d in all", step, reason,
                           self.in_a_row, len(self.skipped_steps))
        if self.in_a_row >= self.max_skipped_steps:
            first = step - self.in_a_row + 1
            raise UserError(f"steps {first}-{step} were all skipped ({reason} at step {step}): training does not "
                            f"recover; resume from an earlier checkpoint with a lower --lr, check the data, or "
                            f"raise --max-skipped-steps {self.max_skipped_steps}")
        return "spike" if finite else "non-finite"

    def state_dict(self) -> dict:
        """JSON-able, exact: fp32 losses survive the round trip through Python floats."""
        num_recent = int(self.num_recent)
        return {"skipped_steps": list(self.skipped_steps), "in_a_row": self.in_a_row,
                "recent_losses": self.recent[self.window - num_recent:].tolist() if num_recent else []}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's state (None: one written before skips existed, taken as none skipped).
        Another --spike-window keeps the newest losses that fit."""
        state = state or {}
        self.skipped_steps = [int(s) for s in state.get("skipped_steps", [])]
        self.in_a_row = int(state.get("in_a_row", 0))
        saved = [float(x) for x in state.get("recent_losses", [])]
        kept = min(self.window, len(saved))
        self.recent.zero_()
        if kept:
            self.recent[self.window - kept:] = torch.tensor(saved[len(saved) - kept:], dtype=torch.float32)
        self.num_recent.fill_(kept)

    @property
    def total_skipped(self) -> int:
        return len(self.skipped_steps)
