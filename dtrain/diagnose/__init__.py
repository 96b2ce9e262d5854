"""Why a run was slow, ran out of memory or diverged: `python -m dtrain.diagnose RUN_DIR`.

    journal.py     what a run writes for diagnosis (RUN_DIR/metrics.jsonl) and reading it back
    record.py      a run directory read back: configuration, journal, failures, the planner's target
    neighbours.py  the layouts next to the run's, by the planner, as the flags that change
    speed.py       measured against predicted, where the step goes, faster neighbours
    memory.py      the peak against the GPU; after an out-of-memory error, the nearest layout that fits
    loss.py        spikes, non-finite steps, growth before them, trends, the LR schedule
    ranks.py       stragglers, hangs, failures and restarts
    report.py      sections and findings, as text (under 40 lines) and JSON
    plot.py        --plot; profile.py: --profile
    breakdown.py   where a profiled step's time went, by category (a live profile or a Chrome trace)
    __main__.py    the command line
"""
