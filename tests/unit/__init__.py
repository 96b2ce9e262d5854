"""The quick tier (`python -m pytest -q tests/unit`, a few minutes on two cores): tests that run in
the pytest process itself: the model math, the sharding plan on a fake world or one gloo rank, the
planner, configuration and errors. tests/unit/conftest.py fails a test here that starts a process."""
