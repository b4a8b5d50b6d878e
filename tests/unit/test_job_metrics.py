"""The dashboards' pure parts: the coordinator's tallies, the Prometheus text, a replica's sinks."""

from __future__ import annotations

import importlib.util

import pytest

from recover.config import load_config
from recover.errors import ConfigError
from recover.observe import sinks
from recover.observe.jobmetrics import JobMetrics
from recover.observe.prometheus import Family, MetricsServer, render
from recover.observe.tensorboard import event, scalar_value

SNAPSHOT = {"generation": 2, "members": [0, 2], "committed_step": 6, "live": [0, 1, 2], "pending_join": []}


class Board:
    """Records what a TensorBoard writer is given."""

    def __init__(self) -> None:
        self.scalars_at: list[tuple[int, dict[str, float]]] = []
        self.texts: list[tuple[int, str, str]] = []

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        self.scalars_at.append((step, dict(values)))

    def text(self, step: int, tag: str, text: str, wall_time: float | None = None) -> None:
        self.texts.append((step, tag, text))


def feed(metrics: JobMetrics) -> None:
    metrics.on_event("generation", {"generation": 1, "members": [0, 1, 2], "joined": [], "dead": []})
    for step in range(3):
        metrics.on_event("commit", {"generation": 1, "step": step, "ids": 8})
    metrics.on_event("failure_detected", {"replica": 1, "cause": "connection_closed", "generation": 1})
    metrics.on_event("generation", {"generation": 2, "members": [0, 2], "joined": [], "dead": [1]})
    metrics.on_event("failure_detected", {"replica": 2, "cause": "hung", "generation": 2})
    metrics.on_event("failure_detected", {"replica": 0, "cause": "hung", "generation": 2})
    metrics.on_event("left", {"replica": 2, "generation": 2})  # a goodbye is no failure


def test_tallies_become_prometheus_families() -> None:
    metrics = JobMetrics()
    feed(metrics)
    fams = {f.name: f for f in metrics.families(SNAPSHOT)}
    assert fams["recover_generation"].samples == [({}, 2)] and fams["recover_members"].samples == [({}, 2)]
    assert fams["recover_live_replicas"].samples == [({}, 3)] and fams["recover_committed_step"].samples == [({}, 6)]
    assert fams["recover_failures_total"].type == "counter"
    assert fams["recover_failures_total"].samples == [({"cause": "connection_closed"}, 1), ({"cause": "hung"}, 2)]
    (_, ratio), = fams["recover_goodput"].samples
    assert 0 <= ratio <= 1 and fams["recover_step_seconds"].samples[0][1] >= 0


def test_no_step_seconds_before_two_commits() -> None:
    names = [f.name for f in JobMetrics().families(SNAPSHOT)]
    assert "recover_step_seconds" not in names and "recover_goodput" in names


def test_the_board_gets_generations_step_times_and_faults_at_the_step_in_progress() -> None:
    board = Board()
    metrics = JobMetrics(board)  # type: ignore[arg-type]
    feed(metrics)
    metrics.on_event("generation", {"generation": 3, "members": [0, 1], "joined": [1], "dead": []})
    gens = [(s, v) for s, v in board.scalars_at if "job/generation" in v]
    assert gens == [(0, {"job/generation": 1, "job/members": 3}), (3, {"job/generation": 2, "job/members": 2}),
                    (3, {"job/generation": 3, "job/members": 2})]
    assert [s for s, v in board.scalars_at if "job/step_s" in v] == [1, 2]
    assert board.texts == [(3, "faults", "failure: replica 1 (connection_closed), generation 1"),
                           (3, "faults", "failure: replica 2 (hung), generation 2"),
                           (3, "faults", "failure: replica 0 (hung), generation 2"),
                           (3, "faults", "joined: replica [1], generation 3")]
    metrics.sample()
    assert "job/goodput" in board.scalars_at[-1][1]


def test_goodput_is_cached_between_commits() -> None:
    metrics = JobMetrics(min_age_s=60)
    feed(metrics)
    first = metrics.goodput()
    metrics._events.append({"kind": "launch", "t": 0.0})  # would change the ratio if recomputed
    assert metrics.goodput() == first


def test_render_is_the_text_exposition_format() -> None:
    text = render([Family("recover_failures_total", "Failures by cause.", "counter", [({"cause": 'a "b"\\c\nd'}, 2)]),
                   Family("recover_goodput", "Goodput.", "gauge", [({}, 0.5)])])
    assert text == ("# HELP recover_failures_total Failures by cause.\n# TYPE recover_failures_total counter\n"
                    'recover_failures_total{cause="a \\"b\\"\\\\c\\nd"} 2.0\n'
                    "# HELP recover_goodput Goodput.\n# TYPE recover_goodput gauge\nrecover_goodput 0.5\n")


def test_a_taken_or_impossible_port_is_one_line() -> None:
    server = MetricsServer("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=rf"^--metrics-port {server.port}: cannot listen on 127.0.0.1:"):
            MetricsServer("127.0.0.1", server.port)
    finally:
        server.close()
    with pytest.raises(ConfigError, match="--metrics-port 70000 is not a port number"):
        MetricsServer("127.0.0.1", 70000)


def test_step_records_become_dashboard_scalars() -> None:
    record = {"step": 4, "loss": 2.5, "val_loss": 2.4, "tokens_per_s": 1e4, "time_s": 0.2, "lr": 1e-3,
              "grad_norm": 0.7, "live_replicas": 3, "generation": 2, "computed": 3, "quotas": {"0": 3},
              "stragglers": {"1": 2.0}, "replica": 0, "deterministic": True}
    assert sinks.scalars(record) == {"train/loss": 2.5, "train/val_loss": 2.4, "perf/tokens_per_s": 1e4,
                                     "perf/step_s": 0.2, "train/lr": 1e-3, "train/grad_norm": 0.7,
                                     "job/live_replicas": 3, "job/generation": 2, "perf/microbatches_computed": 3}


def test_observe_config_and_the_missing_wandb_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    cfg = load_config("debug", ["--observe.tensorboard", "true"])
    assert sinks.StepSinks.open(load_config("debug"), tmp_path, "replica_0") is None
    opened = sinks.StepSinks.open(cfg, tmp_path, "replica_3")
    assert opened is not None and opened.run is None
    opened.step({"step": 0, "loss": 3.0})
    opened.close()
    (path,) = (tmp_path / "tensorboard" / "replica_3").iterdir()
    assert event(0.0, 0, [scalar_value("train/loss", 3.0)])[9:] in path.read_bytes()  # after the wall time
    with pytest.raises(ConfigError, match="observe.wandb = 'on' is not allowed"):
        load_config("debug", ["--observe.wandb", "on"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    sinks.check_extras(cfg.observe)  # not asked for: fine without it
    with pytest.raises(ConfigError, match=r"^observe.wandb = 'offline' needs the wandb package: "
                                          r"pip install 'recover-llm\[wandb\]'"):
        sinks.check_extras(load_config("debug", ["--observe.wandb", "offline"]).observe)



def test_the_coordinators_goodput_counts_from_the_launch_as_recover_status_does(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prometheus' recover_goodput and `recover status` disagreed mid-run: the coordinator counted its wall time
    from its own start, the status from the launch. The coordinator now starts from the run's last launch event."""
    import json
    import time
    from pathlib import Path

    from recover.coord.cli import launch_time
    from recover.launch.records import StepRecords
    from recover.launch.status import job_status

    t0 = time.time() - 30.0
    events = [{"t": t0 - 100.0, "kind": "launch", "replicas": 2, "steps": 9},  # an earlier launch of the run
              {"t": t0, "kind": "launch", "replicas": 2, "steps": 20}]
    path = Path(tmp_path) / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert launch_time(str(path)) == t0 and launch_time(None) is None
    clock = [t0 + 10.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    metrics = JobMetrics(started=launch_time(str(path)), min_age_s=0.0)
    own = JobMetrics(min_age_s=0.0)  # counted from the coordinator's own start (10 s after the launch)
    for m in (metrics, own):
        m.on_event("generation", {"generation": 1, "members": [0, 1], "joined": [], "dead": []})
    seen = [events[1], {"t": clock[0], "kind": "generation", "generation": 1, "members": [0, 1]}]
    for step in range(10):
        clock[0] += 1.0
        for m in (metrics, own):
            m.on_event("commit", {"generation": 1, "step": step, "ids": 8})
        seen.append({"t": clock[0], "kind": "commit", "generation": 1, "step": step})
    records = StepRecords({"step": s, "loss": 1.0, "t": t0 + 11.0 + s, "tokens": 8, "time_s": 1.0,
                           "live_replicas": 2} for s in range(10))
    status = job_status(seen, records, {0: 9, 1: 9}, now=clock[0])["goodput"]["ettr"]
    assert metrics.goodput() == pytest.approx(status, abs=1e-3) == 0.5  # 10 useful s of 20
    assert own.goodput() > 0.85  # what it said before
