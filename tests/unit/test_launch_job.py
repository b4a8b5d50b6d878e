"""What a launch starts (commands, the config its workers read) and when its random faults strike."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from recover.config import load_config, write_run_config
from recover.errors import ConfigError
from recover.faults import HANG_SIGNAL, FailureSchedule, parse_failure, random_kinds
from recover.launch.cli import worker_config
from recover.launch.faultclock import FaultClock
from recover.launch.job import Address, Commands, LaunchOptions


def test_workers_read_the_runs_config_json_and_nothing_else_of_the_config(tmp_path: Path) -> None:
    cfg = load_config("debug", ["--parallel.replicas=3", "--training.steps=7", "--model.vocab_size=320"])
    opts = LaunchOptions(config=cfg, out=tmp_path, failures=FailureSchedule([parse_failure("1@3:reduce")]))
    cmds, addr = Commands(opts), Address("127.0.0.1", 5000, 5001, tmp_path / "token")
    cmd = cmds.replica(addr, resume=True, rid=1, join=True)
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "config.json")
    assert not [a for a in cmd if a.startswith("--") and "." in a]  # no override: the config file says it all
    assert cmd[-5:] == ["--replica", "1", "--fail", "1@3:reduce", "--join"] and "--resume" in cmd
    assert cmds.replica(addr, resume=False, rid=0, join=False)[-2:] == ["--replica", "0"]
    assert json.loads(cmds.spare_order(1)) == {"replica": 1, "fail": ["1@3:reduce"]}
    write_run_config(cfg, tmp_path)
    assert worker_config(str(tmp_path / "config.json"), []) == cfg


def test_a_replica_started_again_is_not_given_the_injected_faults_that_struck_already(tmp_path: Path) -> None:
    """A replica that restores an older checkpoint goes through the step of its fault again: once per launch."""
    cfg = load_config("debug", ["--parallel.replicas=2"])
    failures = FailureSchedule([parse_failure("1@3:reduce"), parse_failure("1@9=hang", rank=0)])
    cmds = Commands(LaunchOptions(config=cfg, out=tmp_path, failures=failures))
    assert cmds.fails(1) == ["1@3:reduce", "1@9:forward=hang#0"]
    cmds.struck.add("1@9:forward=hang#0")
    assert cmds.fails(1) == ["1@3:reduce"]


@pytest.mark.parametrize(("text", "says"), [
    (None, "is unreadable"),
    ("{not json", "is unreadable"),
    ('["a", "list"]', "is not a JSON object"),
    ('{"model_type": "llama", "hidden_size": 64}', "is not a run config of this recover"),
])
def test_a_worker_given_an_unreadable_or_foreign_config_json_fails_in_one_line(tmp_path: Path, text: str | None,
                                                                               says: str) -> None:
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        worker_config(str(path), [])
    message = str(err.value)
    assert says in message and str(path) in message and "\n" not in message
    assert "config.json that `recover launch` wrote" in message


def test_random_faults_start_with_training_and_never_leave_too_few_replicas() -> None:
    def clock() -> FaultClock:
        return FaultClock(mtbf_s=1.0, faults=random_kinds(), ranks=2, min_replicas=1, seed=3)

    quiet = clock()
    assert all(quiet.tick(t, {}, dict.fromkeys([0, 1, 2], 0.0)) is None for t in range(100))  # nobody trained yet
    strikes = []
    for c in (clock(), clock()):
        times = [i * 0.1 for i in range(400)]
        strikes.append([(t, s) for t in times
                        if (s := c.tick(t, {0: t, 1: t, 2: t - 5.0}, dict.fromkeys([0, 1, 2], -10.0))) is not None])
    assert strikes[0] == strikes[1] and len(strikes[0]) > 10  # the seed decides: same calls, same strikes
    hit = {s for _, s in strikes[0]}
    assert {s.replica for s in hit} == {0, 1}  # replica 2 recorded no step in the last 2 s: not training
    assert {s.rank for s in hit} == {0, 1} and {s.fault for s in hit} == {"kill", "hang", "freeze"}
    assert {s.signal for s in hit} == {signal.SIGKILL, HANG_SIGNAL, signal.SIGSTOP}
    alone = clock()
    assert all(alone.tick(t * 0.1, {0: t * 0.1}, {0: 0.0}) is None for t in range(400))  # one left of min 1: never
    # replica 1 was just started in place of a struck one: its predecessor's steps do not make it a holder of
    # the state, so replica 0 is the only one training and is never struck (it would leave nobody)
    restarted = clock()
    assert all(restarted.tick(t * 0.1, {0: t * 0.1, 1: t * 0.1}, {0: 0.0, 1: 1e9}) is None for t in range(400))


def test_the_coordinator_admits_replica_ids_below_max_replicas_default_replicas(tmp_path: Path) -> None:
    cfg = load_config("debug", ["--parallel.replicas=3"])
    addr = Address("127.0.0.1", 5000, 5001, tmp_path / "token")
    for given, told in ((None, "3"), (5, "5")):
        cmd = Commands(LaunchOptions(config=cfg, out=tmp_path, max_replicas=given)).coordinator(addr, 3, first=True)
        assert cmd[cmd.index("--max-replicas") + 1] == told and cmd[cmd.index("--replicas") + 1] == "3"


def test_the_coordinator_serves_metrics_and_writes_the_job_board_when_asked(tmp_path: Path) -> None:
    addr = Address("127.0.0.1", 5000, 5001, tmp_path / "token")
    plain = Commands(LaunchOptions(config=load_config("debug"), out=tmp_path)).coordinator(addr, 2, first=True)
    assert "--metrics-port" not in plain and "--tensorboard" not in plain
    cfg = load_config("debug", ["--observe.tensorboard", "true"])
    cmd = Commands(LaunchOptions(config=cfg, out=tmp_path, metrics_port=9400)).coordinator(addr, 2, first=False)
    assert cmd[cmd.index("--metrics-port") + 1] == "9400"
    assert cmd[cmd.index("--tensorboard") + 1] == str(tmp_path / "tensorboard" / "job")


def test_the_coordinator_reads_the_runs_config_and_its_flags_override_it(tmp_path: Path) -> None:
    """The coordinator's settings come from the run's config.json, as the workers' do (hang_timeout_s was spelled
    on the launcher's command line and checked separately); a flag given still overrides its field."""
    from recover.cli import build_parser
    from recover.coord.cli import Settings

    cfg = load_config("debug", ["--parallel.replicas=3", "--fault_tolerance.hang_timeout_s=7",
                                "--fault_tolerance.min_replicas=2", "--fault_tolerance.heartbeat_interval_s=0.2"])
    write_run_config(cfg, tmp_path)
    addr = Address("127.0.0.1", 5000, 5001, tmp_path / "token")
    cmd = Commands(LaunchOptions(config=cfg, out=tmp_path)).coordinator(addr, 3, first=True)
    assert "--hang-timeout" not in cmd and cmd[cmd.index("--config") + 1] == str(tmp_path / "config.json")
    args = build_parser().parse_args(cmd[cmd.index("coordinator"):])
    st = Settings.of(args)
    assert (st.replicas, st.min_replicas, st.hang_timeout_s, st.heartbeat_interval_s) == (3, 2, 7.0, 0.2)
    args = build_parser().parse_args([*cmd[cmd.index("coordinator"):], "--hang-timeout", "9"])
    assert Settings.of(args).hang_timeout_s == 9.0
    hand = build_parser().parse_args(["coordinator", "--token-file", "t"])  # started by hand: no config
    assert Settings.of(hand) == Settings()
    with pytest.raises(ConfigError, match="--heartbeat-timeout"):
        Settings.of(build_parser().parse_args([*cmd[cmd.index("coordinator"):], "--heartbeat-timeout", "0.1"]))
