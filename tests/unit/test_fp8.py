"""FP8 matmuls through torchao: emulated on CPU (the same casts, high-precision GEMMs), native
FP8 GEMMs on Hopper GPUs (marked gpu)."""

import pytest

from dtrain.run import main


@pytest.mark.parametrize("extra,message", [
    (["--fp8", "tensorwise", "--precision", "fp32"], "use --precision bf16"),
    (["--fp8", "tensorwise", "--model-overrides", "dim=72,ffn_dim=200"], "multiple of 16"),
    (["--fp8", "tensorwise", "--fp8-backend", "te"], "--fp8-backend te"),
    (["--fp8-head"], "give --fp8 RECIPE"),
    (["--fp8", "tensorwise", "--fp8-head", "--model-overrides", "vocab_size=2040"], "[2040]"),
])
def test_bad_fp8_settings(extra, message, capsys):
    assert main(["--model", "tiny", *extra, "--print-plan"]) == 2
    assert message in capsys.readouterr().err


def test_fp8_emulated_on_the_cpu_is_said_once_at_the_start(tmp_path, caplog):
    from tests.launch import TINY_ARGS

    caplog.set_level("INFO", logger="dtrain")
    assert main([*TINY_ARGS, "--precision", "bf16", "--steps", "2", "--fp8", "tensorwise",
                 "--run-dir", str(tmp_path)]) == 0
    said = [r.getMessage() for r in caplog.records if "is emulated on" in r.getMessage()]
    assert said == ["--fp8 tensorwise is emulated on the CPU (no FP8 matmuls): the numerics of FP8, not its speed"]
    first_step = next(i for i, r in enumerate(caplog.records) if "step 1/2" in r.getMessage())
    assert any("is emulated on" in r.getMessage() for r in caplog.records[:first_step])
