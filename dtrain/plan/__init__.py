"""Choosing and checking a run's layout before it runs.

    validate.py  every check of a configuration that needs no memory, and the sharding plan it
                 resolves to
    describe.py  `--print-plan`: the plan of a configuration, printed without training
"""
