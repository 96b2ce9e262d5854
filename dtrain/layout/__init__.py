"""A run's layout, decided once before anything runs.

    machine.py     what the machine a run is resolved for is (device, GPU profile, FP8 GEMMs)
    checks.py      every check of a run's options
    resolve.py     `resolve`: the options, checked and decided, as a RunLayout; `with_choices`
    run_layout.py  `RunLayout`: the decisions, read by the runtime, the planner, the dry run and tools
    host_memory.py whether a CPU run's ranks fit in their hosts' memory, by the memory model
    defaults.py    the options left unset that resolve chooses for the GPU by the memory model
"""

from dtrain.layout.machine import Machine
from dtrain.layout.resolve import resolve, with_choices
from dtrain.layout.run_layout import RunLayout

__all__ = ["Machine", "RunLayout", "resolve", "with_choices"]
