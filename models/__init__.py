"""The functional model core: configs, parameter specs with logical axes, pure forward functions.

Nothing here knows about meshes, ranks or collectives; forward functions reach the parallel
backend only through the context object they are handed (see `models.context`).
"""
