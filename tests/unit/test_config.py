"""Config: attrs defaults, TOML file, command-line flags, --help, to_toml round trip."""

from __future__ import annotations

import tomllib

import attrs
import pytest

from dtrain import command_line
from dtrain.config import (
    GROUPS, Config, DataArgs, ModelArgs, OptimArgs, ParallelArgs, TrainArgs, build_parser, load_config, to_toml,
)
from models.errors import UserError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


ALL_FIELDS = [(group, field) for group, cls in GROUPS.items() for field in attrs.fields(cls)]


def test_groups_are_the_config_fields():
    assert GROUPS == {"model": ModelArgs, "parallel": ParallelArgs, "data": DataArgs,
                      "optim": OptimArgs, "train": TrainArgs}


def test_defaults_equal_attrs_defaults():
    config = load_config([])
    assert config == Config()
    for group, field in ALL_FIELDS:
        assert getattr(getattr(config, group), field.name) == field.default, (group, field.name)


def test_argv_none_reads_sys_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["dtrain.run", "--steps", "7"])
    assert load_config(None).train.steps == 7


def test_flags_override_defaults():
    config = load_config([
        "--model", "llama-1b", "--mesh", "tp=2,pp=2", "--sequence-parallel", "--seq-len", "128",
        "--micro-batch", "2", "--global-batch", "64", "--lr", "1e-4", "--decay", "wsd",
        "--tokenizer", "tok.json", "--compile", "--recompute", "selective", "--precision", "fp32",
        "--seed", "3", "--run-dir", "runs/x", "--steps", "50", "--eps", "1e-6",
    ])
    assert config.model.model == "llama-1b"
    assert config.parallel == ParallelArgs(mesh="tp=2,pp=2", sequence_parallel=True)
    assert config.data == DataArgs(seq_len=128, micro_batch=2, global_batch=64, tokenizer="tok.json")
    assert config.optim == OptimArgs(lr=1e-4, decay="wsd", eps=1e-6)
    assert isinstance(config.optim.lr, float) and isinstance(config.data.seq_len, int)
    assert config.train == TrainArgs(compile=True, recompute="selective", precision="fp32", seed=3,
                                     run_dir="runs/x", steps=50)


def test_bad_choice_is_a_user_error():
    with pytest.raises(UserError, match="argument --decay: invalid choice: 'exponential'"):
        load_config(["--decay", "exponential"])


TOML = """
[model]
model = "llama3-8b"

[parallel]
mesh = "dp=2,tp=4"
sequence_parallel = true

[data]
seq_len = 512
tokenizer = "/data/tok.json"

[optim]
lr = 0.0005
decay = "linear"

[train]
steps = 1000
compile = true
"""


def test_toml_file_is_loaded(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    config = load_config(["--config", str(path)])
    assert config.model.model == "llama3-8b"
    assert config.parallel == ParallelArgs(mesh="dp=2,tp=4", sequence_parallel=True)
    assert config.data == DataArgs(seq_len=512, tokenizer="/data/tok.json")
    assert config.optim == OptimArgs(lr=0.0005, decay="linear")
    assert config.train == TrainArgs(steps=1000, compile=True)


def test_flags_win_over_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    # Flags before and after --config both win over the file.
    config = load_config(["--lr", "0.01", "--config", str(path), "--mesh", "tp=8", "--no-compile",
                          "--no-sequence-parallel", "--steps", "5"])
    assert config.optim.lr == 0.01
    assert config.optim.decay == "linear"               # from the file
    assert config.parallel == ParallelArgs(mesh="tp=8", sequence_parallel=False)
    assert config.train == TrainArgs(steps=5, compile=False)
    assert config.data.seq_len == 512                   # from the file


def test_partial_toml_keeps_other_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[optim]\nwarmup_steps = 3\n")
    config = load_config(["--config", str(path)])
    assert config == attrs.evolve(Config(), optim=OptimArgs(warmup_steps=3))


@pytest.mark.parametrize(
    "text, must_name",
    [
        ("[optimizer]\nlr = 0.1\n", "optimizer"),              # unknown table
        ("lr = 0.1\n", "lr"),                                   # a top-level key is no table
        ("[optim]\nlearning_rate = 0.1\n", "learning_rate"),   # unknown key
        ("[optim]\nlr = \n", "not valid TOML"),
    ],
)
def test_bad_toml_raises_user_error(tmp_path, text, must_name):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_config(["--config", str(path)])
    assert must_name in str(info.value)
    assert str(path) in str(info.value)


def test_missing_config_file_raises_user_error(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(UserError, match="nope.toml"):
        load_config(["--config", str(missing)])


def _help_text(capsys, argv_runner) -> str:
    with pytest.raises(SystemExit) as info:
        argv_runner()
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())   # undo argparse's line wrapping


def _flag_text(group: str, field) -> str:
    if field.type is bool:
        return f"{_flag(field.name)}, --no-{field.name.replace('_', '-')}"
    if field.metadata.get("const") is not None:  # the value may be left out: `--resume`
        return f"{_flag(field.name)} [{field.name.upper()}]"
    return f"{_flag(field.name)} {field.name.upper()}"


def _check_defaults_listed(text: str) -> None:
    options = text[text.index("options:"):]
    positions = []
    for group, field in ALL_FIELDS:
        position = options.find(_flag_text(group, field))
        assert position >= 0, (group, field.name)
        positions.append(position)
    for i, (group, field) in enumerate(ALL_FIELDS):
        end = min(e for e in [*positions, len(options)] if e > positions[i])
        entry = options[positions[i]:end]
        assert f"(default: {field.default})" in entry, (group, field.name, entry)


def test_help_exits_zero_and_lists_every_flag(capsys):
    text = _help_text(capsys, lambda: load_config(["--help"]))
    options = text[text.index("options:"):]
    for group, field in ALL_FIELDS:
        assert _flag_text(group, field) in options, (group, field.name)
    for section in command_line.SECTIONS:
        assert f"{section}:" in options


def test_parser_help_lists_defaults(capsys):
    _check_defaults_listed(_help_text(capsys, lambda: build_parser().parse_args(["--help"])))


def test_help_lists_every_default(capsys):
    _check_defaults_listed(_help_text(capsys, lambda: load_config(["--help"])))


def _custom_config() -> Config:
    return Config(
        model=ModelArgs(model="llama3-70b"),
        parallel=ParallelArgs(mesh="tp=8,pp=8,cp=2", sequence_parallel=True, print_plan=True),
        data=DataArgs(data='C:\\data\\"quoted" corpus.txt', tokenizer="/tmp/tok.json", seq_len=8192),
        optim=OptimArgs(lr=1.5e-4, min_lr_ratio=0.0, warmup_steps=2000, decay="wsd", eps=1e-10),
        train=TrainArgs(steps=100000, seed=1234, compile=True, recompute="full", run_dir="runs/70b"),
    )


@pytest.mark.parametrize("config", [Config(), _custom_config()], ids=["defaults", "custom"])
def test_to_toml_round_trip(tmp_path, config):
    text = to_toml(config)
    loaded = tomllib.loads(text)
    expected = {group: {k: v for k, v in table.items() if v is not None}
                for group, table in config.to_dict().items()}
    assert loaded == expected
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    assert load_config(["--config", str(path)]) == config


def test_to_toml_escapes_control_characters(tmp_path):
    config = attrs.evolve(Config(), train=TrainArgs(run_dir="runs/a\nb\tc"))
    assert tomllib.loads(to_toml(config))["train"]["run_dir"] == "runs/a\nb\tc"


def test_toml_value_of_wrong_type_is_rejected(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[data]\nseq_len = 1.5\n')
    with pytest.raises(UserError, match="seq_len = 1.5 should be of type int"):
        load_config(["--config", str(path)])
