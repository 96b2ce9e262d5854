"""The options a run chooses where its user left them unset (dtrain/layout/defaults.py, inside
`resolve`): the largest micro-batch that the memory model fits, blocks kept gathered where that
fits too, a flag given always kept, each choice recorded in the layout with its reason, and nothing
chosen differently without a GPU to size for (CPU runs keep the defaults they always had)."""

from __future__ import annotations


def test_a_run_logs_each_choice_with_its_reason(tmp_path):
    from tests.launch import run_cli

    run_dir = tmp_path / "run"
    result = run_cli(["--model", "tiny", "--steps", "1", "--precision", "fp32", "--seq-len", "64", "--global-batch",
                      "4", "--gpu-memory-gb", "80", "--run-dir", str(run_dir), "--data", "synthetic"])
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "--micro-batch 4: the largest that fits 80 GB by the memory model" in log
    assert "micro_batch = 4" in (run_dir / "config.toml").read_text()
