"""A run's layout, decided once before anything runs.

    checks.py       every check of a configuration that needs no memory, and the sharding plan it
                    resolves to
    host_memory.py  whether a CPU run's ranks fit in their hosts' memory, by the memory model
"""
