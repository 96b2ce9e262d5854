"""A run is resolved once (dtrain.layout.resolve): its decisions as one value, the same value
whether the planner derives a variant or a run resolves it, every check made once per run, and
`--print-plan --json` printing it. One process, no subprocess."""

from __future__ import annotations

import attrs

from dtrain.config import load_config
from dtrain.layout import resolve
from dtrain.planner.candidates import Target
from dtrain.planner.search import search


def test_the_planners_candidates_are_the_layouts_their_commands_resolve_to():
    target = Target(model="llama3-8b", gpus=16, seq_len=8192, global_batch=32, gpu_memory_gb=80)
    for candidate in search(target)[:8]:
        flags = candidate.command.split(" -m dtrain.run ", 1)[1].split()
        # The same decisions; the options differ only where the planner has no say (the data).
        run = resolve(load_config(flags), 16, target.machine)
        assert candidate.layout == attrs.evolve(run, config=candidate.config)
