"""The end-to-end tier (`python -m pytest -q tests/integration`): runs of several processes over
gloo, the command line, checkpoints resumed and damaged, launchers and faults, compiled graphs, and
the planner and the dry run at the size of real clusters."""
