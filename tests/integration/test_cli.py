"""The command line: bad input fails early with one line that says what to change; --print-plan."""

from tests.launch import TINY_ARGS, run_cli


def test_user_error_exits_without_traceback(tmp_path):
    result = run_cli([*TINY_ARGS, "--run-dir", str(tmp_path), "--mesh", "pp=0"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["dtrain: error: mesh size pp=0 must be >= 1"]
