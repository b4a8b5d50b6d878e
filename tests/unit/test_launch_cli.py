"""`recover launch` refuses a bad job up front: one line on stderr, exit 2, nothing created or started."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from conftest import refusal
from recover.cli import build_parser
from recover.errors import ConfigError
from recover.launch.cli import LaunchRequest, check_launch
from recover.launch.demo import demo_failures
from recover.names import Baseline, Phase

TP3_SWIGLU = ["--config", "debug", "--replicas", "1", "--procs-per-replica", "3", "--tp", "3",
              "--model.dim", "96", "--model.n_heads", "6", "--model.n_kv_heads", "6"]


@pytest.mark.parametrize(("args", "field", "says"), [
    (TP3_SWIGLU, "parallel.tp", "must divide the SwiGLU width 256"),
    (["--config", "debug", "--pp", "3"], "parallel.pp", "at most model.n_layers = 2"),
    (["--config", "debug", "--replicas", "3", "--training.global_microbatches", "2"],
     "training.global_microbatches", "at least parallel.replicas x parallel.fsdp = 3"),
    (["--config", "debug", "--parallel.backend", "mpi"], "parallel.backend", "one of 'auto', 'gloo', 'nccl'"),
    (["--config", "debug", "--procs-per-replica", "2"], "--procs-per-replica", "pp x tp x fsdp = 1 x 1 x 1 = 1"),
    (["--config", "debug", "--fail", "0@3:backwrd"], "phase 'backwrd'", "did you mean 'backward'"),
    (["--config", "debug", "--slow", "1@3:0.5"], "slow-down factor 0.5", "a number >= 1"),
    (["--config", "debug", "--random-failures", "5", "--random-faults", "kill,crash"], "--random-faults kill,crash",
     "some of kill, hang, freeze"),
    (["--config", "debug", "--replicas", "3", "--max-replicas", "2"], "--max-replicas 2", "at least --replicas (3)"),
    (["--config", "debug", "--metrics-port", "70000"], "--metrics-port 70000", "is not a port number"),
    (["--config", "debug", "--observe.wandb", "yes"], "observe.wandb", "one of 'off', 'offline', 'online'"),
])
def test_a_bad_launch_is_refused_in_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], field: str, says: str) -> None:
    out = tmp_path / "run"
    start = time.monotonic()
    code, err = refusal(["launch", *args, "--out", str(out), "--no-progress"], capsys)
    elapsed = time.monotonic() - start
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("recover: error: "), err
    assert field in lines[0] and says in lines[0], lines[0]
    assert elapsed < 10, f"refused after {elapsed:.1f} s"
    assert not out.exists()  # no run directory, so no coordinator, no worker, no data


def test_a_metrics_port_in_use_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = refusal(["launch", "--config", "debug", "--out", str(tmp_path / "run"), "--no-progress",
                             "--metrics-port", str(port)], capsys)
    assert code == 2 and err.splitlines() == [f"recover: error: --metrics-port {port}: cannot listen on "
                                              f"127.0.0.1:{port} (Address already in use); choose another port, "
                                              "or 0 for no endpoint"]
    assert not (tmp_path / "run").exists()


def test_a_malformed_command_line_is_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = refusal(["launch", "--config", "debug", "--tp", "three", "--out", str(tmp_path / "run"),
                         "--no-progress"], capsys)
    assert code == 2
    assert err.splitlines() == ["recover launch: error: argument --tp: invalid int value: 'three' "
                                "(see recover launch --help)"]


def test_check_launch_has_no_side_effects(tmp_path: Path) -> None:
    out = tmp_path / "run"
    opts = check_launch(LaunchRequest(out=out, config="debug", replicas=2, failures=("1@3:reduce",),
                                      baseline=Baseline.SHRINK))
    assert opts.config.parallel.replicas == 2 and [str(s) for s in opts.failures] == ["1@3:reduce"]
    assert opts.baseline is Baseline.SHRINK
    with pytest.raises(ConfigError, match=r"needs periodic checkpoints"):
        check_launch(LaunchRequest(out=out, config="debug", baseline=Baseline.RESTART))
    with pytest.raises(ConfigError, match=r"--rejoin-replicas 5 is not allowed: replicas are 0\.\.1"):
        check_launch(LaunchRequest(out=out, config="debug", replicas=2, rejoin_after_s=1.0,
                                   rejoin_replicas=frozenset({5})))
    assert not out.exists()


def test_help_lists_every_phase_and_baseline_from_their_enums(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["launch", "--help"], ["worker", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(command)
        text = "".join(capsys.readouterr().out.split())  # undo the wrapping (it may break at a hyphen)
        for member in (*Phase, *Baseline):
            assert "".join(f"{member.value} ({member.help})".split()) in text, (command, member)


def test_demo_failures_scale_with_the_run() -> None:
    assert demo_failures(40) == ("1@4:backward", "2@10:forward=hang", "3@16:forward=slow:3", "3@24:forward=slow:1",
                                 "0@28:forward=corrupt")
    assert demo_failures(80)[-1] == "0@57:forward=corrupt"


def test_placement_gives_every_rank_its_own_gpu_and_refuses_more_ranks_than_gpus() -> None:
    from recover.launch.placement import parse_gpus, place
    from recover.train.processes.exits import PLACEMENT_ENV

    plan = place(2, 2, parse_gpus("0,1,2,3"))
    assert plan.gpus == {(0, 0): "0", (0, 1): "1", (1, 0): "2", (1, 1): "3"} and not plan.shared
    assert plan.env(1, 1) == {"CUDA_VISIBLE_DEVICES": "3"} and place(2, 2, []).env(0, 0) == {PLACEMENT_ENV: "none"}
    with pytest.raises(ConfigError, match="3 replicas x 2 ranks need 6 GPUs, 4 given"):
        place(3, 2, parse_gpus("0,1,2,3"))
    shared = place(2, 1, ["0"], share=True)
    assert shared.shared and set(shared.gpus.values()) == {"0"}
    assert place(2, 1, [], share=True).shared  # no GPU found: still gloo, the workers share cuda:0 if CUDA works
    assert place(2, 1, [], share=True).env(1, 0) == {PLACEMENT_ENV: "shared"}
    with pytest.raises(ConfigError, match="distinct device ids"):
        parse_gpus("0,0")


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2 replicas of tp=2 on --gpus 0,1,2,3: 4 distinct devices, nothing created; sharing forces gloo."""
    from recover.cli import main

    base = ["launch", "--config", "debug", "--tp", "2", "--gpus", "0,1,2,3", "--dry-run", "--out", str(tmp_path / "r")]
    assert main([*base, "--replicas", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("replica ")]
    assert sorted(line.split("CUDA_VISIBLE_DEVICES=")[1].split()[0] for line in lines) == ["0", "1", "2", "3"]
    assert not (tmp_path / "r").exists()
    assert main([*base, "--replicas", "3"]) == 2
    assert "3 replicas x 2 ranks need 6 GPUs, 4 given" in capsys.readouterr().err
    assert main([*base, "--replicas", "3", "--share-gpus"]) == 0
    assert "parallel.backend=gloo" in capsys.readouterr().out


def test_a_worker_that_sees_cuda_the_launcher_did_not_refuses_to_share_gpu_0_silently() -> None:
    from recover.train.processes.worker import worker_device

    assert worker_device(0, "none", 4) == "cpu"
    assert worker_device(1, None, 4) == "cuda:0"  # given its own GPU (or started by torchrun / a cluster recipe)
    assert worker_device(8, "none", 1) == "cuda:0"  # one process alone cannot collide
    assert worker_device(1, "shared", 4) == "cuda:0"  # --share-gpus: on purpose, over gloo
    with pytest.raises(ConfigError, match="would all use GPU 0: pass --gpus 0,1,... .* or --share-gpus"):
        worker_device(8, "none", 4)


@pytest.mark.parametrize(("split", "kind"), [("val", "validation"), ("train", "training")])
def test_an_empty_split_is_refused_by_launch_and_train_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   split: str, kind: str) -> None:
    """A split whose shards hold no token (a data directory not made by `recover prepare`, which records no
    counts to compare with): refused before any worker starts, not by every worker at its start."""
    import json

    from recover.data import prepare_files
    from recover.data.shards import write_shard

    (tmp_path / "a.txt").write_text("def main():\n    return 0\n" * 400)
    (tmp_path / "b.txt").write_text("import os\nprint(os.sep)\n" * 400)
    data = tmp_path / "data"
    prepare_files([tmp_path / "a.txt", tmp_path / "b.txt"], data, val_fraction=0.5, quiet=True)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "shard_info"}))
    write_shard(data / f"{split}_000000.bin", [], fmt="llmc")
    for command in (["launch", "--replicas", "2"], ["train"]):
        out = tmp_path / command[0]
        code, err = refusal([*command, "--config", "debug", "--data.path", str(data), "--out", str(out),
                             "--no-progress"], capsys)
        assert code == 2 and err.splitlines() == [
            f"recover: error: {data / f'{split}_*.bin'}: the {kind} split is empty (0 tokens in 1 shard(s)); give it "
            f"data (`recover prepare` writes both splits) or name other shards with --data.{split}_pattern"], err
        assert not out.exists()


def test_spare_devices_are_the_cpu_or_gpus_no_rank_holds() -> None:
    from recover.launch.placement import parse_gpus, place

    assert place(3, 1, []).spare_devices(1, 2) == [(None,), (None,)]
    assert place(2, 2, parse_gpus("0,1,2,3,4,5,6")).spare_devices(2, 5) == [("4", "5")]  # GPU 6 is half a replica
    assert place(2, 1, parse_gpus("0,1,2")).spare_devices(1, 0) == []
    assert place(3, 1, ["0"], share=True).spare_devices(1, 1) == []  # every GPU is some rank's


@pytest.mark.parametrize(("flags", "gpus", "spares"), [
    ({"rejoin_after_s": 0.0}, "", 1),                          # the CPU: one by default
    ({}, "", 0),                                               # no rejoins: no spare
    ({"rejoin_after_s": 0.0, "warm_spares": 3}, "", 3),
    ({"rejoin_after_s": 0.0, "warm_spares": 0}, "", 0),
    ({"rejoin_after_s": 0.0}, "0,1", 0),                       # both GPUs hold a rank
    ({"rejoin_after_s": 0.0}, "0,1,2,3", 1),
    ({"rejoin_after_s": 0.0, "warm_spares": 2}, "0,1,2,3", 2),
])
def test_how_many_spares_a_launch_keeps(tmp_path: Path, flags: dict, gpus: str, spares: int) -> None:
    req = LaunchRequest(out=tmp_path / "run", config="debug", replicas=2, gpus=gpus or None, **flags)
    assert check_launch(req).warm_spares == spares


@pytest.mark.parametrize(("flags", "says"), [
    ({"warm_spares": 1}, "give --rejoin-after too"),
    ({"warm_spares": -1, "rejoin_after_s": 0.0}, "--warm-spares -1 is not allowed"),
    ({"warm_spares": 1, "rejoin_after_s": 0.0, "script": ("train.py",)}, "not to a script"),
    ({"warm_spares": 2, "rejoin_after_s": 0.0, "gpus": "0,1,2"}, "needs 2 GPUs that hold no rank; 1 do (2)"),
])
def test_impossible_spares_are_refused(tmp_path: Path, flags: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + r".*" + says.replace("(", r"\(").replace(")", r"\)")):
        check_launch(LaunchRequest(out=tmp_path / "run", config="debug", replicas=2, **flags))
    assert not (tmp_path / "run").exists()


def _fake_checkpoint(out: Path, step: int, **model: object) -> Path:
    """A complete checkpoint directory of the debug model (``model`` fields changed) as far as its
    ``meta.json`` and marker go: what the launcher reads before it starts anything."""
    import dataclasses
    import json

    from recover.config import load_config
    from recover.train.checkpoints.integrity import MARKER, checkpoint_path

    path = checkpoint_path(out / "checkpoints", step)
    path.mkdir(parents=True)
    shape = {**dataclasses.asdict(load_config("debug").model), "vocab_size": 320, **model}
    (path / "meta.json").write_text(json.dumps({"step": step, "model": shape}))
    (path / MARKER).write_text(json.dumps({"step": step}))
    return path


def test_resume_with_another_model_is_refused_once_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 41: the message came from every worker (8 lines, 9 s in), rc 1
    out = tmp_path / "run"
    path = _fake_checkpoint(out, 4, dim=48)
    code, err = refusal(["launch", "--config", "debug", "--replicas", "2", "--out", str(out), "--resume",
                         "--no-progress"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"recover: error: --resume: checkpoint {path} was written for another model "
                          "(model.dim: checkpoint 48, this run 64)"), err
    assert not (out / "logs").exists() and not (out / "config.json").exists()  # nothing started


def test_resume_with_fewer_steps_than_the_checkpoint_holds_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 41: --steps below the checkpoint's step ended with status 0 and nothing said
    out = tmp_path / "run"
    path = _fake_checkpoint(out, 6)
    code, err = refusal(["launch", "--config", "debug", "--steps", "4", "--out", str(out), "--resume",
                         "--no-progress"], capsys)
    assert code == 2 and err.splitlines() == [
        f"recover: error: --resume: the newest checkpoint, {path}, holds 6 committed steps, more than "
        "training.steps = 4: give --steps 6 or more (or a new --out)"], err
    check_launch(LaunchRequest(out=out, config="debug", steps=8, resume=True))  # the same model, steps left: fine

def test_a_script_launch_is_not_checked_against_the_built_in_trainers_settings(tmp_path: Path) -> None:
    """`--steps 3` with the tiny preset's `training.warmup_steps = 5`: refused for the built-in trainer, which
    warms up over those steps; a script has its own schedule, so its launch is not refused for it."""
    with pytest.raises(ConfigError, match="training.warmup_steps"):
        check_launch(LaunchRequest(out=tmp_path / "a", config="tiny", replicas=2, steps=3))
    opts = check_launch(LaunchRequest(out=tmp_path / "b", config="tiny", replicas=2, steps=3,
                                      script=("python", "train.py")))
    assert opts.config.training.steps == 3
    with pytest.raises(ConfigError, match="training.global_microbatches"):  # the built-in M of 8, for 16 replicas
        check_launch(LaunchRequest(out=tmp_path / "c", config="debug", replicas=16))
    opts = check_launch(LaunchRequest(out=tmp_path / "d", config="debug", replicas=16, script=("python", "t.py")))
    assert opts.config.parallel.replicas == 16


def test_init_from_is_refused_for_a_script_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--init-from .*a script builds its own model.*load_state_dict"):
        check_launch(LaunchRequest(out=tmp_path / "run", config="debug", replicas=2, init_from=str(tmp_path),
                                   script=("python", "train.py")))


def test_launch_help_shows_how_to_run_a_script(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--help"])
    assert "recover launch [flags] -- CMD" in " ".join(capsys.readouterr().out.split())
