"""A CPU run checks its hosts' memory against the memory model before it allocates its model: a
model too large for the host is one line that says what it needs and what the host has (a 70B
model allocated until the kernel's out-of-memory killer ended it, minutes later, without a word).
Nothing here allocates a large model: the hosts' readings are stated."""

from __future__ import annotations

import pytest

from tests.launch import TINY_ARGS, run_cli


@pytest.mark.parametrize("host_gb", [0.001, 100.0], ids=["short", "room"])
def test_every_rank_refuses_alike_where_one_host_reading_is_short(tmp_path, host_gb):
    result = run_cli([*TINY_ARGS, "--steps", "1", "--mesh", "dp=2", "--run-dir", str(tmp_path)], nproc=2,
                     module="tests.workers.small_host", env={"DTRAIN_TEST_HOST_GB": str(host_gb)}, timeout=300)
    output = result.stdout + result.stderr
    if host_gb > 1:
        assert result.returncode == 0, output[-3000:]
        return
    assert result.returncode != 0 and output.count("dtrain: error: --model tiny needs ") == 2, output[-3000:]
    assert "lost its peers" not in output, output[-3000:]
