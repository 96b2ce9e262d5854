"""The command line: bad input fails early with one line that says what to change; --print-plan."""

import pytest

from dtrain.run import main
from tests.launch import TINY_ARGS


BAD_INPUTS = [
    (["--mesh", "tq=2"], "bad mesh entry 'tq=2'"),
    (["--mesh", "tp=0"], "tp=0 must be >= 1"),
    (["--mesh", "dp=-2"], "dp_shard=-2 must be >= 1"),
    (["--mesh", "dp=2"], "--mesh dp=2 spans 2 ranks but this is one process: start them with python -m dtrain.run "
                         "--nproc-per-node 2 ..., or check the layout on this machine with --dry-run"),
    (["--mesh", "tp=3", "--print-plan"], "num_heads=4, not divisible by tp=3"),
    (["--global-batch", "7"], "--global-batch 7 is not divisible by --micro-batch 2"),
    (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["--model", "llama-9000"], "unknown model 'llama-9000'"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--tokenizer", "/nonexistent/tokenizer.json"], "/nonexistent/tokenizer.json"),
    (["--resume", "/nonexistent/step_000100"], "--resume /nonexistent/step_000100: no such checkpoint"),
    (["--checkpoint-every", "-5"], "--checkpoint-every -5 must be >= 0"),
    (["--log-every", "-1"], "--log-every -1 must be >= 0"),
    (["--recompute-layers", "5"], "--recompute-layers 5 is more than the 4 blocks of the largest pipeline stage"),
    (["--recompute-layers", "-1"], "--recompute-layers -1 must be >= 0"),
    (["--recompute", "full", "--recompute-layers", "1"], "--recompute full already recomputes every block"),
    (["--cpu-offload", "--fp8", "tensorwise"], "add --no-fp8-all-gather"),
    (["--world-size", "2"], "--world-size 2 is for --dry-run and --print-plan; this run has 1 process"),
    (["--dry-run-rank", "0"], "--dry-run-rank needs --dry-run"),
    (["--loss-chunk-tokens", "-1"], "--loss-chunk-tokens -1 must be >= 0"),
    (["--fp8", "tensorwise", "--fp8-head", "--loss-chunk-tokens", "64"], "--fp8-head runs it in FP8"),
    # Optimizer numbers that torch would refuse mid-setup with a traceback, or take silently.
    (["--lr", "nan"], "--lr nan must be a finite number > 0"),
    (["--lr", "inf"], "--lr inf must be a finite number > 0"),
    (["--warmup-steps", "-3"], "--warmup-steps -3 must be >= 0"),
    (["--beta2", "1.5"], "--beta2 1.5 must be a finite number in [0, 1)"),
    (["--grad-clip", "-1"], "--grad-clip -1.0 must be a finite number >= 0 (0: no clipping)"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio 2.0 must be a finite number in [0, 1]"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a finite number >= 0"),
]


@pytest.mark.parametrize("extra,message", BAD_INPUTS, ids=[" ".join(e) for e, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line(extra, message, tmp_path, capsys):
    code = main([*TINY_ARGS, "--run-dir", str(tmp_path / "run"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("dtrain: error: ") and "\n" not in err, err
    assert message in err, err
    # Rejected before any work: not even the run directory was made.
    assert not (tmp_path / "run").exists()


def test_diverging_loss_stops_with_clear_error(tmp_path, capsys):
    code = main([*TINY_ARGS, "--run-dir", str(tmp_path), "--lr", "1e30", "--warmup-steps", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "lower --lr" in err, err


def test_print_plan_shows_placements_without_a_world(capsys):
    assert main(["--model", "llama3-8b", "--mesh", "dp=4,tp=2", "--print-plan"]) == 0
    out = capsys.readouterr().out
    assert "mesh: dp_shard=4,tp=2 (world size 8)" in out
    row = next(line for line in out.splitlines() if line.startswith("blocks.0.mlp.w_down"))
    # [4096, 14336]: tp splits the input dim (14336 / 2), FSDP dim 0 over dp_shard (4096 / 4).
    assert row.split()[1:] == ["embed,mlp", "dp_shard:S(0)", "tp:S(1)", "4096x14336", "1024x7168"]


def test_print_plan_shows_the_pipeline_stages_and_takes_enough_micro_batches(capsys):
    # The card's command as typed: no --global-batch, so the pipeline takes 2 x pp micro-batches.
    assert main(["--model", "llama3-70b", "--mesh", "tp=8,pp=8,cp=2", "--print-plan"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("pipeline: 1f1b, 8 stages"):].splitlines()
    assert "16 micro-batches per step" in lines[0]
    rows = [line.split() for line in lines[2:10]]
    assert [int(row[0]) for row in rows] == list(range(8))
    assert sum(int(row[1]) for row in rows) == 80  # every block on exactly one stage
    assert rows[0][2:4] == ["embedding", "+"] and rows[-1][-3:-2] == ["head"]
    # pp is the outermost mesh dim: pipeline rank r holds ranks 16r .. 16r + 15.
    assert [row[-1] for row in rows] == [f"{16 * r}-{16 * r + 15}" for r in range(8)]


def test_print_plan_plans_for_world_size(capsys):
    assert main(["--model", "llama3-70b", "--mesh", "tp=8,pp=8", "--world-size", "1024", "--print-plan"]) == 0
    out = capsys.readouterr().out
    assert "mesh: pp=8,dp_shard=16,tp=8 (world size 1024)" in out and "0-127" in out


def test_run_dir_holds_config_log_and_tensorboard(tmp_path):
    assert main([*TINY_ARGS, "--steps", "2", "--run-dir", str(tmp_path)]) == 0
    assert 'model = "tiny"' in (tmp_path / "config.toml").read_text()
    log = (tmp_path / "train.log").read_text()
    assert "step 2/2 | loss" in log and "mesh single" in log
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_log_every_zero_prints_the_last_step_only(tmp_path, caplog):
    assert main([*TINY_ARGS, "--steps", "3", "--run-dir", str(tmp_path), "--log-every", "0"]) == 0
    steps = [line for line in caplog.text.splitlines() if " | loss " in line]
    assert len(steps) == 1 and "step 3/3 | loss" in steps[0], caplog.text[-2000:]
