"""Imported once by the fork server of tests/forked.py, so that forked ranks start with torch and
dtrain's heavy modules in memory."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401

import dtrain.train  # noqa: E402,F401
