"""Context parallelism through the CLI: loss parity against one process for each --cp-comm and
combined with tensor, sequence and data parallelism (CPU, gloo, fp32, 10 steps, relative loss
difference <= 1e-4 at every step)."""

import pytest

from dtrain.run import main
from tests.launch import TINY_ARGS


@pytest.mark.parametrize("extra,message", [
    (["--mesh", "cp=3", "--print-plan"], "--seq-len 64 is not divisible by 2 x cp = 6"),
    (["--mesh", "cp=4", "--cp-comm", "a2a", "--print-plan"], "--cp-comm a2a splits heads over cp=4"),
    (["--mesh", "cp=2", "--synthetic-document-length", "8", "--print-plan"], "use it with --data synthetic"),
    (["--model-overrides", "sliding_window=0", "--print-plan"], "sliding_window=0 must be >= 1"),
])
def test_bad_context_parallel_settings(extra, message, capsys):
    assert main([*TINY_ARGS, *extra]) == 2
    assert message in capsys.readouterr().err
