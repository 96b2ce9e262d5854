"""The command line as a newcomer meets it: a typo answered in one line with the flag it was close
to, --help in sections without measured figures, --list-models, and under several ranks one line
per mistake."""

from __future__ import annotations

import re

import pytest

from dtrain import command_line
from dtrain.config import build_parser
from dtrain.run import main
from models.presets import PRESETS
from tests.launch import TINY_ARGS


@pytest.mark.parametrize("argv,message", [
    (["--micro-bach", "2"], "unknown flag --micro-bach: did you mean --micro-batch?"),
    (["--stpes=3"], "unknown flag --stpes: did you mean --steps?"),
    (["--frobnicate"], "unknown flag --frobnicate (python -m dtrain.run --help lists the flags)"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
])
def test_a_flag_mistake_is_one_line_with_the_close_match(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("dtrain: error: ") and "\n" not in err, err
    assert message in err, err
    assert "usage:" not in captured.out + captured.err


def test_help_is_in_sections_by_task_without_measured_figures(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    headings = [line[:-1] for line in text.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert headings == ["options", *command_line.SECTIONS], headings
    section = text[text.index("\nprecision:"):text.index("\ndata:")]
    assert "--fp8 " in section and "--fp8-backend" in section and "--mesh" not in section
    assert "--resume" in text[text.index("\ncheckpoint:"):text.index("\nresilience:")]
    # Help states what a flag does; measurements belong to the benchmarks.
    for action in build_parser()._actions:
        assert not re.search(r"measured|\d\s*(%|TFLOP|tok/s|ms\b)|H100|H200", action.help or ""), action.help


def test_every_field_has_one_help_section():
    listed = [name for names in command_line.SECTIONS.values() for name in names]
    assert len(listed) == len(set(listed))
    fields = {action.dest.split(".")[1] for action in build_parser()._actions if "." in action.dest}
    assert set(listed) <= fields, set(listed) - fields


def test_list_models_prints_every_preset_with_its_family_and_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--list-models"])
    assert exit_info.value.code == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(PRESETS)
    assert rows["llama3-8b"] == ["Llama", "8.0B", "all"]
    assert rows["mixtral-8x7b"] == ["Mixtral", "46.7B", "12.9B"]  # the published 46.7B total, 12.9B active


def test_a_multi_rank_mesh_in_one_process_names_the_launch_flag_and_the_dry_run(tmp_path, capsys):
    assert main([*TINY_ARGS, "--run-dir", str(tmp_path / "run"), "--mesh", "tp=2,pp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("dtrain: error: --mesh tp=2,pp=2 spans 4 ranks but this is one process: start them with python "
                   "-m dtrain.run --nproc-per-node 4 ..., or check the layout on this machine with --dry-run "
                   "(every rank's memory and collectives) or --print-plan"), err
