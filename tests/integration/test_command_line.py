"""The command line as a newcomer meets it: a typo answered in one line with the flag it was close
to, --help in sections without measured figures, --list-models, and under several ranks one line
per mistake."""

from __future__ import annotations

import pytest

from tests.launch import TINY_ARGS, run_cli


@pytest.mark.parametrize("case", ["options", "agreed in training"])
def test_under_several_ranks_a_mistake_is_said_once(tmp_path, case):
    run_dir = tmp_path / "run"
    extra = ["--global-batch", "6"]
    if case == "agreed in training":
        run_dir.mkdir()
        (run_dir / "train.log").write_text("an earlier run\n")
        extra = []
    result = run_cli([*TINY_ARGS, "--steps", "1", "--run-dir", str(run_dir), *extra], nproc=2)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("dtrain: error:") == 1, output[-3000:]
    assert ("holds another run" if extra == [] else "--global-batch 6") in output, output[-3000:]
