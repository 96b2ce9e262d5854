"""The unit tier runs in this one process: a test here that starts a process (a subprocess, a fork,
torchrun's ranks, a compile worker) fails and belongs in tests/integration."""

import multiprocessing.process
import os
import subprocess

import pytest


class StartedAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise StartedAProcess("a unit test started a process: move it to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
