"""`recover status RUN_DIR`: a job's state from its events and step records (pure, and the command in process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.cli import main
from recover.launch.records import StepRecords
from recover.launch.status import job_status

T = 1000.0


def job_events() -> list[dict]:
    """4 replicas; replica 3 killed at step 5 and restarted (waiting to join); replica 1 finished and left."""
    return [
        {"t": T, "kind": "launch", "replicas": 4, "steps": 20},
        {"t": T + 1, "kind": "generation", "generation": 1, "members": [0, 1, 2, 3], "step": 0},
        {"t": T + 2, "kind": "rebalanced", "step": 3, "speeds": {"0": 0.01, "1": 0.01, "2": 0.01, "3": 0.03}},
        {"t": T + 3, "kind": "kill", "replica": 3, "step": 5, "phase": "forward", "fault": "kill"},
        {"t": T + 3.1, "kind": "failure_detected", "replica": 3, "cause": "connection_closed", "generation": 1},
        {"t": T + 3.2, "kind": "generation", "generation": 2, "members": [0, 1, 2], "step": 5},
        {"t": T + 3.5, "kind": "rejoin_started", "replica": 3, "pid": 7},
        {"t": T + 4, "kind": "left", "replica": 1, "generation": 2},
    ]


def test_each_replica_has_the_state_the_last_event_about_it_says() -> None:
    records = StepRecords({"step": s, "loss": 1.0, "t": T + 1 + s * 0.1, "tokens": 10, "time_s": 0.1,
                           "live_replicas": 3} for s in (*range(8), 9))  # step 8 missing: 8 committed
    s = job_status(job_events(), records, {0: 7, 1: 7, 2: 7, 3: 4}, now=T + 5, faults=2)
    assert (s["generation"], s["members"], s["committed_steps"], s["planned_steps"]) == (2, [0, 1, 2], 8, 20)
    assert [(r["replica"], r["state"], r["last_step"], r["planned"]) for r in s["replicas"]] == [
        (0, "training", 7, 0.01), (1, "left", 7, 0.01), (2, "training", 7, 0.01), (3, "joining", 4, 0.03)]
    assert [e["kind"] for e in s["faults"]] == ["kill", "failure_detected"] and 0 < s["goodput"]["ettr"] <= 1


def test_the_command_reads_a_run_directory_and_refuses_one_without_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "replicas").mkdir()
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in job_events()))
    (tmp_path / "replicas" / "replica_0.jsonl").write_text(
        json.dumps({"step": 0, "loss": 2.0, "t": T + 2, "tokens": 10, "time_s": 0.1, "replica": 0}) + "\n{torn")
    assert main(["status", str(tmp_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["committed_steps"] == 1 and [r["state"] for r in s["replicas"]] == ["training", "left", "training",
                                                                               "joining"]
    assert main(["status", str(tmp_path)]) == 0 and "generation 2" in capsys.readouterr().out
    assert main(["status", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no events.jsonl" in err[0]


def test_a_drained_member_is_draining_until_the_generation_without_it() -> None:
    ev = [*job_events(), {"t": T + 4.5, "kind": "drain_requested", "replica": 2, "step": 9, "generation": 2}]
    s = job_status(ev, StepRecords(), {}, now=T + 5)
    assert [r["state"] for r in s["replicas"]] == ["training", "left", "draining", "joining"]
    ev.append({"t": T + 4.8, "kind": "generation", "generation": 3, "members": [0], "step": 10})
    ev.append({"t": T + 4.9, "kind": "left", "replica": 2, "generation": 3})
    assert [r["state"] for r in job_status(ev, StepRecords(), {}, now=T + 5)["replicas"]][2] == "left"


@pytest.mark.parametrize("argv, words", [([], "give a run directory"), (["RUN", "--coordinator", "h:1"], "not both"),
                                         (["--coordinator", "h:1"], "needs --token-file")])
def test_a_status_needs_a_run_directory_or_a_coordinator_with_its_token(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_a_coordinators_status_renders_its_activity_and_the_age_of_its_faults() -> None:
    from rich.console import Console

    from recover.launch.status import status_table

    s = {"generation": 3, "members": [0, 1], "committed_steps": 12, "goodput": None,
         "replicas": [{"replica": 0, "state": "computing", "activity": "compute", "mb_s": 0.25},
                      {"replica": 1, "state": "draining", "activity": "wait", "mb_s": None},
                      {"replica": 2, "state": "lost", "activity": None, "mb_s": None}],
         "faults": [{"kind": "failure_detected", "replica": 2, "cause": "hung", "step": 9, "ago_s": 4.0}]}
    console = Console(width=160, record=True)
    console.print(status_table(s, "127.0.0.1:29400"))
    text = " ".join(console.export_text().split())  # rich wraps the title and caption to the table's width
    assert "127.0.0.1:29400: generation 3, members [0, 1], 12 steps committed" in text
    assert "activity" in text and "last step" not in text and "0.2500" in text and "draining" in text
    assert "failure_detected replica 2: step 9, cause hung" in text
