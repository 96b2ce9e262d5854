"""Choosing and checking a run's layout before it runs.

    validate.py    every check of a configuration that needs no memory, and the sharding plan it
                   resolves to
    describe.py    `--print-plan`: the plan of a configuration and its pipeline stages, printed
                   without training
    roles.py       which ranks of a world run the same program, from the mesh and the stage split
    accounting.py  live bytes and collectives of a run on fake tensors
    dry_run.py     `--dry-run`: one step of every distinct rank's real program, on fake tensors
"""
