"""Config: presets, typed dotted overrides and one-line errors naming field, value and what is allowed."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from recover.cli import main
from recover.config import (
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    available_presets,
    check_layout,
    load_config,
    parse_overrides,
)
from recover.errors import ConfigError
from recover.workload.policy import ASSIGNMENTS


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
        # the replica's layout, checked with the config (not when the workers start)
        (["--parallel.tp", "3", "--model.dim", "96", "--model.n_heads", "6", "--model.n_kv_heads", "6"],
         "parallel.tp = 3 is not allowed: must divide the SwiGLU width 256 (derived from model.dim = 96"),
        (["--parallel.tp", "2", "--model.ffn_dim", "129"],
         "parallel.tp = 2 is not allowed: must divide model.ffn_dim = 129; set --model.ffn_dim 130"),
        (["--parallel.tp", "4", "--model.n_kv_heads", "2"],
         "parallel.tp = 4 is not allowed: must divide model.n_heads = 4 and the kv heads = 2"),
        (["--parallel.pp", "3", "--model.tie_embeddings", "false"],
         "parallel.pp = 3 is not allowed: at most model.n_layers = 2"),
        (["--parallel.pp", "2"], "model.tie_embeddings = True is not allowed: false with parallel.pp = 2"),
        (["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--data.seq_len", "63"],
         "data.seq_len = 63 is not allowed: a multiple of parallel.tp = 2 with parallel.sequence_parallel"),
        (["--parallel.sequence_parallel", "true"], "parallel.sequence_parallel = True is not allowed"),
        (["--parallel.fsdp", "2", "--parallel.replicas", "2", "--fault_tolerance.audit_every", "2"],
         "fault_tolerance.audit_every = 2 is not allowed: 0 with replicas of 2 ranks (pp x tp x fsdp)"),
        # choices come from the fields' Literal types
        (["--parallel.backend", "glo"],
         "parallel.backend = 'glo' is not allowed: one of 'auto', 'gloo', 'nccl' (did you mean 'gloo'?)"),
        (["--parallel.schedule", "zb"], "parallel.schedule = 'zb' is not allowed: one of '1f1b', 'gpipe'"),
        (["--training.assignment", "random"],
         "training.assignment = 'random' is not allowed: one of 'blocks', 'strided', 'shuffled'"),
        (["--data.format", "bin"], "data.format = 'bin' is not allowed: one of 'auto', 'llmc', 'nanogpt'"),
    ],
)
def test_bad_values_name_field_value_and_rule(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("debug", overrides)
    assert expected in str(info.value)


def test_the_suggested_mlp_width_fix_works() -> None:
    layout = ["--parallel.tp", "3", "--model.dim", "96", "--model.n_heads", "6", "--model.n_kv_heads", "6"]
    cfg = load_config("debug", [*layout, "--model.ffn_multiple_of", "96"])
    assert cfg.model.hidden_dim == 288 and cfg.model.hidden_dim % cfg.parallel.tp == 0
    assert load_config("debug", [*layout, "--model.ffn_dim", "258"]).model.hidden_dim == 258


def test_check_layout_is_the_one_rule_for_a_replica() -> None:
    model = ModelConfig(dim=96, n_heads=6, n_layers=2)  # SwiGLU width 256
    check_layout(model, pp=1, tp=2)
    with pytest.raises(ConfigError, match=r"^parallel\.tp = 3 is not allowed: must divide the SwiGLU width 256"):
        check_layout(model, tp=3)
    with pytest.raises(ConfigError, match=r"^parallel\.pp = 3 is not allowed"):
        check_layout(model, pp=3)


def test_choices_are_checked_from_the_literal_type_everywhere(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.backend = 'mpi' is not allowed: one of 'auto', 'gloo', 'nccl'$"):
        ParallelConfig(backend="mpi")  # type: ignore[arg-type]
    path = tmp_path / "bad.toml"
    path.write_text('[parallel]\nschedule = 3\n')
    with pytest.raises(ConfigError, match=r"^parallel\.schedule = 3 is not allowed: one of '1f1b', 'gpipe'$"):
        load_config(str(path))
    assert load_config("debug", ["--parallel.schedule", "gpipe"]).parallel.schedule == "gpipe"
    assert typing.get_args(typing.get_type_hints(TrainingConfig)["assignment"]) == ASSIGNMENTS


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


def test_the_reduction_overlaps_the_backward_on_gpus_unless_told() -> None:
    from recover.config import FaultToleranceConfig

    assert FaultToleranceConfig().overlaps("cuda") and not FaultToleranceConfig().overlaps("cpu")
    assert FaultToleranceConfig(overlap_reduction="on").overlaps("cpu")
    assert not FaultToleranceConfig(overlap_reduction="off").overlaps("cuda")
    with pytest.raises(ConfigError, match="overlap_reduction"):
        FaultToleranceConfig(overlap_reduction="sometimes")  # type: ignore[arg-type]


def test_data_sources_from_the_command_line_toml_and_config_json(tmp_path: Path) -> None:
    from dataclasses import asdict

    from recover.config import DataSource, from_dict

    cfg = load_config("debug", ["--data.sources", "web=0.7,code/py=0.3"])
    assert cfg.data.sources == (DataSource("web", 0.7), DataSource("code/py", 0.3))
    assert [(part.path, w) for part, w in cfg.data.parts()] == [("web", 0.7), ("code/py", 0.3)]
    assert all(part.seq_len == cfg.data.seq_len and part.sources == () for part, _ in cfg.data.parts())
    assert from_dict(json.loads(json.dumps(asdict(cfg)))) == cfg  # config.json round trip
    toml = tmp_path / "mix.toml"
    toml.write_text('[data]\nsources = [{path = "a", weight = 2}, {path = "b"}]\n')
    assert load_config(str(toml)).data.sources == (DataSource("a", 2.0), DataSource("b", 1.0))
    assert load_config("debug").data.parts() == [(load_config("debug").data, 1.0)]
    for bad, message in (("a=x", "is not PATH=WEIGHT"), ("a=0", "a positive weight"), ("a=1,a=2", "each path once")):
        with pytest.raises(ConfigError, match=message):
            load_config("debug", ["--data.sources", bad])
    toml.write_text('[data]\nsources = [{path = "a", share = 2}]\n')
    with pytest.raises(ConfigError, match="is not a"):
        load_config(str(toml))


def test_checkpoint_every_is_a_count_or_auto_from_the_command_line_toml_and_config_json(tmp_path: Path) -> None:
    assert load_config("debug", ["--training.checkpoint_every", "auto"]).training.checkpoint_every == "auto"
    assert load_config("debug", ["--training.checkpoint_every=7"]).training.checkpoint_every == 7
    path = tmp_path / "auto.toml"
    path.write_text('[training]\ncheckpoint_every = "auto"\n[fault_tolerance]\nmtbf_s = 3600\n')
    cfg = load_config(str(path))
    assert cfg.training.checkpoint_every == "auto" and cfg.fault_tolerance.mtbf_s == 3600.0
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert load_config(str(tmp_path / "config.json")).training.checkpoint_every == "auto"
    for bad, rule in (("often", "expected int or 'auto'"), ("2.5", "expected int or 'auto'"),
                      ("-1", "an integer >= 0 (steps between saves; 0: none) or 'auto' (Young/Daly)")):
        with pytest.raises(ConfigError) as info:
            load_config("debug", ["--training.checkpoint_every", bad])
        shown = bad if bad == "-1" else repr(bad)
        assert str(info.value) == f"training.checkpoint_every = {shown} is not allowed: {rule}"
    with pytest.raises(ConfigError, match=r"^training\.checkpoint_every = True is not allowed"):
        TrainingConfig(checkpoint_every=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^fault_tolerance\.mtbf_s = -1\.0 is not allowed: a number of seconds"):
        load_config("debug", ["--fault_tolerance.mtbf_s", "-1"])


def _numeric_fields() -> list[tuple[str, type]]:
    """Every float and int field of every section, as ``section.field`` with its type."""
    import dataclasses

    from recover.config import _SECTION_TYPES, _field_types

    return [(f"{section}.{f.name}", _field_types(cls)[f.name]) for section, cls in _SECTION_TYPES.items()
            for f in dataclasses.fields(cls) if _field_types(cls)[f.name] in (int, float)]


@pytest.mark.parametrize("name", [n for n, t in _numeric_fields() if t is float])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
def test_every_float_field_is_refused_when_not_finite(name: str, bad: str) -> None:
    # issue 41: --training.lr inf was accepted (> 0 holds for inf) and every replica was fenced at step 1
    with pytest.raises(ConfigError, match=rf"^{name} = (-?inf|nan) is not allowed: a finite number$"):
        load_config("debug", [f"--{name}", bad])


@pytest.mark.parametrize("name", [n for n, t in _numeric_fields() if t is int])
def test_every_int_field_fits_64_bits(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name} = {2**64} is not allowed"):
        load_config("debug", [f"--{name}", str(2**64)])


def test_durations_are_bounded() -> None:
    with pytest.raises(ConfigError, match=r"fault_tolerance.collective_timeout_s = 1e\+300 is not allowed: at most "
                                          r"2592000 seconds"):
        load_config("debug", ["--fault_tolerance.collective_timeout_s", "1e300"])


def test_a_step_too_large_for_memory_is_refused_with_the_fields_and_the_fix() -> None:
    # issue 41: --training.global_microbatches 1e12 was accepted; every worker died of MemoryError
    with pytest.raises(ConfigError, match=r"^training.global_microbatches = 1000000000000 is not allowed: at most "
                                          r"1,048,576 .*fewer, larger microbatches \(data.microbatch_size\)$"):
        load_config("debug", ["--training.global_microbatches", "1000000000000"])
    with pytest.raises(ConfigError) as err:
        load_config("debug", ["--training.global_microbatches", "1048576", "--data.microbatch_size", "4096"])
    msg = str(err.value)
    assert msg.startswith("training.global_microbatches = 1048576 is not allowed with data.microbatch_size = 4096 "
                          "and data.seq_len = 64: a step of 274,877,906,944 tokens holds")
    assert "more than half of this machine's" in msg and msg.endswith("lower one of them")
    cfg = load_config("debug", ["--training.global_microbatches", "1024"])  # a large step that fits is kept
    assert cfg.training.global_microbatches == 1024


def test_a_section_built_alone_checks_its_numbers_too() -> None:
    from recover.config import TrainingConfig
    from recover.model.spec import ModelConfig

    with pytest.raises(ConfigError, match="training.lr = inf is not allowed: a finite number"):
        TrainingConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match="model.init_std = nan is not allowed: a finite number"):
        ModelConfig(init_std=float("nan"))
