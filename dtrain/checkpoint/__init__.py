"""Checkpoints of the whole train state.

    storage.py       the on-disk format (DCP shards, meta.json, RNG states), the atomic commit,
                     pruning, and the checks that refuse a bad checkpoint in one line
    checkpointer.py  when a run saves (periodic, final, on a stop signal) and what it starts from
                     (--resume on any mesh, --init-from-hf)
"""
