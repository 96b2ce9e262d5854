"""A run's layout and each rank's program, shown without training.

    describe.py        `--print-plan`: the sharding plan, the pipeline stages, memory per rank
    roles.py           which ranks of a world run the same program, from the mesh and the stage split
    accounting.py      live bytes and collectives of a run on fake tensors
    dry_run.py         `--dry-run`: one step of every distinct rank's real program, on fake tensors
    dry_run_report.py  what the dry run measures, and the text it prints
"""
