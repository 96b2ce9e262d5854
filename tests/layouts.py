"""Layouts of command lines, resolved as a run of them would be (`dtrain.layout.resolve`), on the
CPU processes the tests run (or a stated machine)."""

from __future__ import annotations

from dtrain.config import load_config
from dtrain.layout import Machine, RunLayout, resolve


def resolved(args: list[str], world_size: int | None = 1, machine: Machine = Machine()) -> RunLayout:
    return resolve(load_config(args), world_size, machine)
