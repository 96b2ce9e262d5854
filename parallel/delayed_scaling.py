"""Delayed scaling's train state (Transformer Engine's DelayedScaling recipe, kept by dtrain): for
each FP8 matmul of each layer, three per-tensor scales (input, weight, output gradient) and the
history of the amaxes (max |value|) those tensors had.

    scaling = DelayedScaling(history_len=1024, amax_groups=[dp_group, tp_group], grad_scale=loss_scale)
    views = scaling.add_layers({"blocks.0": 7, "blocks.1": 7})   # one LayerScaling per layer
    ...                                                          # forward/backward quantize with them
    scaling.update()                                             # once per optimizer step

Within a step the scales are constants: every quantization of the step (each micro-batch, the
recompute of a checkpointed block, the backward) uses the same scale and max-accumulates its
amax into row 0 of the history, so a recomputed forward quantizes exactly as the first one did.
After the step, `update` takes the max of row 0 over the ranks that hold other parts of the same
tensors (the data, context and tensor-parallel ranks of one pipeline stage), sets each scale to
fp8_max / max(history) / 2^margin as TE does, and rolls the history. The scales are then those
of one device that saw the whole global batch, on every rank alike.

The output gradients carry the loss scale the trainer multiplies each rank's summed loss by
(data-parallel size x cp / global batch tokens); a checkpoint records it, and a run resumed with
another one (another mesh, another global batch) rescales the gradient amaxes and scales to it.
"""

from __future__ import annotations

import logging

import attrs
import torch
import torch.distributed as dist

logger = logging.getLogger("dtrain")

SLOTS = ("input", "weight", "grad_output")
# TE's HYBRID format: E4M3 for the forward tensors, E5M2 (more range) for the gradients.
FP8_MAX = {"input": torch.finfo(torch.float8_e4m3fn).max, "weight": torch.finfo(torch.float8_e4m3fn).max,
           "grad_output": torch.finfo(torch.float8_e5m2).max}
GRAD_SCALE_KEY = "grad_scale"


@attrs.frozen
class LayerScaling:
    """One layer's matmuls: `scales[i]` and `amaxes[i]` are matmul i's three slots ([3] views);
    `scale_block` and `amax_block` are all of them at once ([matmuls, 3] views)."""

    scales: tuple[torch.Tensor, ...]
    amaxes: tuple[torch.Tensor, ...]
    scale_block: torch.Tensor
    amax_block: torch.Tensor


@attrs.define
class _Part:
    """The layers added together (one model part): one history and one scale buffer for them."""

    layers: dict[str, tuple[int, int]]  # layer name -> (first column, number of matmuls)
    amax_history: torch.Tensor  # [history_len, 3 x matmuls], row 0 the current step
    scale: torch.Tensor  # [3 x matmuls]
    fp8_max: torch.Tensor  # [3 x matmuls]


class DelayedScaling:
    def __init__(self, *, history_len: int = 1024, margin: int = 0, device: torch.device | None = None,
                 amax_groups: list | None = None, grad_scale: float = 1.0):
        if history_len < 1:
            raise ValueError(f"history_len {history_len} must be >= 1")
        self.history_len, self.margin = history_len, margin
        self.device = device if device is not None else torch.device("cpu")
        self.amax_groups = list(amax_groups or [])
        self.grad_scale = grad_scale
        self.parts: list[_Part] = []

    def add_layers(self, matmuls: dict[str, int]) -> dict[str, LayerScaling]:
        """Buffers for these layers (name -> number of FP8 matmuls in one forward); every view
        is made here, before any forward, so that compiled code only reads tensors it is given."""
        columns, layers = 0, {}
        for name, count in matmuls.items():
            layers[name] = (columns, count)
            columns += len(SLOTS) * count
        fp8_max = torch.tensor([FP8_MAX[slot] for _ in range(columns // len(SLOTS)) for slot in SLOTS],
                               dtype=torch.float32, device=self.device)
        part = _Part(layers, torch.zeros(self.history_len, columns, device=self.device),
                     torch.ones(columns, device=self.device), fp8_max)
        self.parts.append(part)
        views = {}
        for name, (first, count) in layers.items():
            spans = [slice(first + len(SLOTS) * i, first + len(SLOTS) * (i + 1)) for i in range(count)]
            block = slice(first, first + len(SLOTS) * count)
            views[name] = LayerScaling(tuple(part.scale[s] for s in spans),
                                       tuple(part.amax_history[0, s] for s in spans),
                                       part.scale[block].view(count, len(SLOTS)),
                                       part.amax_history[0, block].view(count, len(SLOTS)))
        return views

    @torch.no_grad()
    def update(self) -> None:
        """After a step: amaxes reduced over `amax_groups`, new scales, history rolled."""
        for part in self.parts:
            current = part.amax_history[0]
            for group in self.amax_groups:
                dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
            amax = part.amax_history.amax(dim=0)
            scale = part.fp8_max / amax / 2.0**self.margin
            # TE's rules: no amax yet (0) or a non-finite one keeps the old scale; a scale that
            # overflows fp32 (a tiny amax) becomes fp32's max.
            keep = (amax <= 0) | ~torch.isfinite(amax)
            scale = torch.where(keep, part.scale, scale)
            scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
            part.scale.copy_(scale)
            part.amax_history.copy_(part.amax_history.roll(-1, dims=0))
            part.amax_history[0].zero_()

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per layer `NAME.amax_history` [history_len, 3 x matmuls] and `NAME.scale`, plus the
        gradient scale they were taken with. Equal on every rank of a stage after `update`."""
        state = {GRAD_SCALE_KEY: torch.tensor(self.grad_scale, dtype=torch.float64)}
        for part in self.parts:
            for name, columns in _columns(part).items():
                state[f"{name}.amax_history"] = part.amax_history[:, columns].clone()
                state[f"{name}.scale"] = part.scale[columns].clone()
        return state

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each entry of `state_dict`, without building it."""
        shapes = {GRAD_SCALE_KEY: ()}
        for part in self.parts:
            for name, (_, count) in part.layers.items():
                shapes[f"{name}.amax_history"] = (self.history_len, len(SLOTS) * count)
                shapes[f"{name}.scale"] = (len(SLOTS) * count,)
        return shapes

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Takes each layer found in `state` (another history length keeps the newest rows that
        fit); rescales the gradient slots to this run's gradient scale. Returns the layers that
        were not there (they start afresh)."""
        saved_grad_scale = float(state.get(GRAD_SCALE_KEY, torch.tensor(self.grad_scale)))
        ratio = self.grad_scale / saved_grad_scale
        missing = []
        for part in self.parts:
            for name, columns in _columns(part).items():
                history, scale = state.get(f"{name}.amax_history"), state.get(f"{name}.scale")
                if history is None or scale is None or scale.shape != part.scale[columns].shape:
                    missing.append(name)
                    continue
                _copy_history(part.amax_history, columns, history.to(part.amax_history))
                part.scale[columns] = scale.to(part.scale)
                if ratio != 1.0:
                    grads = columns[SLOTS.index("grad_output")::len(SLOTS)]
                    part.amax_history[:, grads] *= ratio
                    part.scale[grads] /= ratio
        if missing:
            total = sum(len(part.layers) for part in self.parts)
            logger.info("FP8 delayed scaling starts afresh for %d of %d layers (not in the checkpoint: %s)",
                        len(missing), total, ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else ""))
        return missing


def _copy_history(into: torch.Tensor, columns: list[int], saved: torch.Tensor) -> None:
    """Row 0 (the current step's amaxes) and as many of the newest past rows as fit. `update`
    rolls the newest amax to the last row, so the past runs from row 1 (oldest) to the last."""
    into[:, columns] = 0.0
    into[0, columns] = saved[0]
    keep = min(into.shape[0], saved.shape[0]) - 1
    if keep > 0:
        into[into.shape[0] - keep:, columns] = saved[saved.shape[0] - keep:]


def _columns(part: _Part) -> dict[str, list[int]]:
    return {name: list(range(first, first + len(SLOTS) * count)) for name, (first, count) in part.layers.items()}


def amax_reduction_dims(mesh_sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh dims whose ranks hold other parts of the tensors one matmul quantizes: other rows
    (dp_replicate, dp_shard, cp) or other columns (tp). Pipeline stages hold other layers."""
    return tuple(dim for dim in ("dp_replicate", "dp_shard", "cp", "tp") if mesh_sizes.get(dim, 1) > 1)

