"""Config: presets, typed dotted overrides and one-line errors naming field, value and what is allowed."""

from __future__ import annotations

import pytest

from recover.cli import main
from recover.config import available_presets, load_config, parse_overrides
from recover.errors import ConfigError


def test_every_preset_loads_and_is_valid() -> None:
    names = available_presets()
    assert {"debug", "tiny", "125m", "1b", "8b"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.name == name
        assert cfg.training.global_microbatches % (cfg.parallel.replicas * cfg.parallel.fsdp) == 0  # balanced


def test_overrides_are_typed() -> None:
    cfg = load_config("debug", ["--training.steps", "50", "--training.lr=0.01", "--model.tie_embeddings", "false",
                                "--data.path", "somewhere"])
    assert cfg.training.steps == 50 and isinstance(cfg.training.steps, int)
    assert cfg.training.lr == 0.01
    assert cfg.model.tie_embeddings is False
    assert cfg.data.path == "somewhere"
    assert parse_overrides(["--a.b=1", "--c.d", "2"]) == {"a.b": "1", "c.d": "2"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--training.stepz", "5"], "unknown config key 'training.stepz'; did you mean 'training.steps'?"),
        (["--trainin.steps", "5"], "unknown config key 'trainin.steps'"),
        (["--training.steps", "many"], "training.steps = 'many' is not allowed: expected int"),
        (["--training.lr", "-0.1"], "training.lr = -0.1 is not allowed: a positive number"),
        (["--training.global_microbatches", "3", "--parallel.replicas", "2", "--parallel.fsdp", "2"],
         "training.global_microbatches = 3 is not allowed: at least parallel.replicas x parallel.fsdp = 4"),
        (["--model.n_heads", "3"], "model.n_heads = 3 is not allowed: must divide model.dim = 64"),
        (["--data.seq_len", "1000"], "data.seq_len = 1000 is not allowed: at most model.max_seq_len = 64"),
        (["--model.tie_embeddings", "maybe"], "model.tie_embeddings = 'maybe' is not allowed: expected bool"),
        (["--training.steps"], "override --training.steps has no value"),
        (["--fault_tolerance.min_replicas", "3"],
         "fault_tolerance.min_replicas = 3 is not allowed: at most parallel.replicas = 1"),
    ],
)
def test_bad_values_name_field_value_and_rule(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("debug", overrides)
    assert expected in str(info.value)


def test_bad_toml_types_are_refused(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"training.steps = 'ten' is not allowed: expected int"):
        load_config(str(path))
    path.write_text("[trainer]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer'; did you mean 'training'\?"):
        load_config(str(path))


def test_unknown_preset_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; available: .*debug"):
        load_config("huge")


def test_cli_prints_one_line_error_and_exits_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    rc = main(["train", "--config", "debug", "--out", str(tmp_path), "--training.lr", "-1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == "recover: error: training.lr = -1.0 is not allowed: a positive number"
