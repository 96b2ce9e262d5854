"""Why a run was slow, ran out of memory or diverged: `python -m dtrain.diagnose RUN_DIR`.

    journal.py  what a run writes for diagnosis (RUN_DIR/metrics.jsonl) and reading it back
"""
