"""The options a run's user left unset, chosen by `resolve` for the GPU the run sizes for: each the
fastest choice that the memory model says fits, recorded with its reason in `RunLayout.chosen`.

    layout = resolve(load_config(["--model", "llama-1b", "--seq-len", "4096"]), 1, Machine.detect())
    for choice in layout.chosen:
        logger.info("%s", choice.line())   # --micro-batch 8: the largest that fits 141 GB ...

- `--micro-batch` unset: the largest power of two that fits by the memory model
  (dtrain/planner/memory.py) with the model's tolerance to spare, up to MAX_MICRO_BATCH_TOKENS
  tokens, among those that split --global-batch as the run needs. One micro-batch of more rows
  runs each step's fixed work (the optimizer, FSDP's copies, launches) over more tokens. Without a
  GPU's memory to size for (a CPU run without --gpu-memory-gb) it is FALLBACK_MICRO_BATCH.
- `--fsdp-reshard-after-forward default`: keeps every block's gathered parameters from its forward
  to its backward (never) where the memory model says that fits at the chosen micro-batch: one
  all-gather per block and micro-batch instead of two.

A value the user gives (flag or TOML) is kept as given. Without a GPU's memory every option keeps
the default it always had, so CPU runs and tests resolve as before.
"""

from __future__ import annotations

from typing import Callable

import attrs

from dtrain.config import Config
from dtrain.layout.machine import Machine
from dtrain.layout.run_layout import Choice, RunLayout
from models.errors import UserError

# Rows of one micro-batch at most: GEMMs are as fast at this many as at more, and an unset
# --global-batch (one micro-batch per data-parallel rank) stays a usual batch.
MAX_MICRO_BATCH_TOKENS = 32768
# The share of a GPU's memory the predicted peak may take: the memory model is within 10% of the
# measured peaks (dtrain/planner/measured.py), and the allocator's caching needs some room.
MEMORY_SHARE = 0.85
# --micro-batch where no GPU's memory sizes it.
FALLBACK_MICRO_BATCH = 4

GB = 1e9

# `vary(layout, **choices)`: `layout` with other values of with_choices' options (and the default
# global batch of another micro-batch), as `resolve` decides them.
Vary = Callable[..., RunLayout]


def unset_sizes(config: Config) -> frozenset[str]:
    """Which of the batch's sizes (micro_batch, global_batch) the user left unset."""
    return frozenset(name for name in ("micro_batch", "global_batch") if getattr(config.data, name) is None)


def memory_to_size_for(config: Config, machine: Machine) -> float | None:
    """--gpu-memory-gb, else the memory of the machine's GPU, else None (nothing to size for)."""
    return config.parallel.gpu_memory_gb if config.parallel.gpu_memory_gb > 0 else machine.gpu_memory_gb


def first_micro_batch(config: Config, memory_gb: float | None) -> Config:
    """`config` with the micro-batch `resolve` lays the run out at before `choose` chooses an unset
    one: 1 (every larger candidate is a variant of it), or FALLBACK_MICRO_BATCH where nothing sizes it."""
    if config.data.micro_batch is not None:
        return config
    first = 1 if memory_gb is not None else FALLBACK_MICRO_BATCH
    return attrs.evolve(config, data=attrs.evolve(config.data, micro_batch=first))


def predicted_gb(layout: RunLayout) -> float:
    """The memory model's peak over the layout's ranks, in GB."""
    from dtrain.planner import memory  # the planner reads layouts: imported where a choice needs it

    return memory.predict_peak(layout)[0].total / GB


def choose(layout: RunLayout, memory_gb: float | None, vary: Vary, unset: frozenset[str],
           predict_gb: Callable[[RunLayout], float] = predicted_gb) -> RunLayout:
    """`layout` with the options its user left unset chosen for `memory_gb` (None: nothing to size
    for), and those choices in `chosen`. `unset`: `unset_sizes` of the options as given;
    `predict_gb`: the memory model (a parameter for tests)."""
    chosen = []
    if "micro_batch" in unset:
        layout, choice = _micro_batch(layout, memory_gb, vary, predict_gb, "global_batch" not in unset)
        chosen.append(choice)
    p = layout.config.parallel
    if p.fsdp_reshard_after_forward == "default" and p.dp_mode == "fsdp":
        layout, choice = _reshard(layout, memory_gb, vary, predict_gb)
        chosen.append(choice)
    return attrs.evolve(layout, chosen=tuple(chosen)) if chosen else layout


def micro_batch_candidates(seq_len: int) -> list[int]:
    """Powers of two up to MAX_MICRO_BATCH_TOKENS tokens (at least 1), smallest first."""
    cap = max(1, MAX_MICRO_BATCH_TOKENS // seq_len)
    return [2**i for i in range(cap.bit_length())]


def _micro_batch(layout: RunLayout, memory_gb: float | None, vary: Vary, predict_gb,
                 global_batch_given: bool) -> tuple[RunLayout, Choice]:
    """The largest candidate whose predicted peak fits MEMORY_SHARE of `memory_gb`."""
    if memory_gb is None:
        return layout, Choice("micro_batch", layout.config.data.micro_batch,
                              "no GPU memory to size it for (give --micro-batch, or --gpu-memory-gb)")
    budget, fits, smallest = MEMORY_SHARE * memory_gb, None, None
    for m in micro_batch_candidates(layout.config.data.seq_len):
        try:
            variant = vary(layout, micro_batch=m)
        except UserError:
            continue  # this micro-batch does not split --global-batch as the run needs
        try:
            predicted = predict_gb(variant)
        except UserError:
            break  # a layout the memory model cannot take
        smallest = smallest or (variant, predicted)
        if predicted > budget:
            break  # larger micro-batches take more
        fits = (variant, predicted)
    if fits is None:
        shown = f"; {smallest[0].config.data.micro_batch} predicts {smallest[1]:.1f} GB" if smallest else ""
        return layout, Choice("micro_batch", layout.config.data.micro_batch,
                              f"none fits {memory_gb:g} GB by the memory model{shown} (python -m dtrain.planner "
                              f"lists layouts that fit)")
    variant, predicted = fits
    split = (f", dividing --global-batch {layout.config.data.global_batch} over the data-parallel ranks"
             if global_batch_given else "")
    return variant, Choice("micro_batch", variant.config.data.micro_batch,
                           f"the largest that fits {memory_gb:g} GB by the memory model ({predicted:.1f} GB "
                           f"predicted, {MEMORY_SHARE:.0%} allowed; at most {MAX_MICRO_BATCH_TOKENS:,} tokens{split})")


def _reshard(layout: RunLayout, memory_gb: float | None, vary: Vary, predict_gb) -> tuple[RunLayout, Choice]:
    """--fsdp-reshard-after-forward default: never where that fits, else as `default` runs."""
    p, mesh, option = layout.config.parallel, layout.mesh, "fsdp_reshard_after_forward"
    if mesh.dp_shard * mesh.cp == 1:
        reduced = ("its gradients reduced after every micro-batch (CPU offload keeps the shards on the host)"
                   if p.cpu_offload else "its gradients reduced once")
        return layout, Choice(option, "default", f"one FSDP shard: nothing is freed after forward; each unit's "
                                                 f"parameters are gathered once per step and {reduced}")
    if mesh.pp > 1 or p.cpu_offload:
        return layout, Choice(option, "default", "pipelined or offloaded blocks keep their own rule")
    if memory_gb is None:
        return layout, Choice(option, "default", "no GPU memory to size it for: every block but the last is freed "
                                                 "after forward")
    never = vary(layout, fsdp_reshard_after_forward="never")
    try:
        predicted = predict_gb(never)
    except UserError:
        return layout, Choice(option, "default", "the memory model cannot size this layout")
    if predicted > MEMORY_SHARE * memory_gb:
        return layout, Choice(option, "default", f"keeping every block gathered would take {predicted:.1f} GB of "
                                                 f"{memory_gb:g} by the memory model: every block but the last is "
                                                 f"freed after forward")
    return never, Choice(option, "never", f"every block stays gathered from its forward to its backward (one "
                                          f"all-gather, not two): {predicted:.1f} GB of {memory_gb:g} by the memory "
                                          f"model")
