"""End to end: every exit of a replica is handled, at any time, whatever its status.

A replica of `recover launch -- python scripts/train_exits.py` ends itself with status 2, 1 or by SIGSEGV,
before the first generation (before it registers) or mid-run: it is replaced (``--rejoin-after``), given up
after failing the same way :data:`~recover.launch.supervisor.MAX_SAME_EXITS` times, or the job goes on
without it; with too few replicas left to start, the job ends within a bound with one line naming the
replica and its log. Every run that finishes is bitwise equal to the failure-free run (one replica:
deterministic steps do not depend on how many replicas share them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import warmstart
from conftest import NO_PLOTS, ROOT, losses, subprocess_env

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "train_exits.py"
STEPS, M = 12, 6  # the script's


def launch(out: Path, *extra: str, replicas: int = 3, env: dict[str, str] | None = None,
           timeout: float = 240, start_timeout_s: float = 4) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recover", "launch", NO_PLOTS,
           "--config", "debug", "--replicas", str(replicas), "--steps",
           str(STEPS), "--out", str(out), "--no-progress", "--deterministic", "--workload.policy=even",
           f"--fault_tolerance.start_timeout_s={start_timeout_s}", *extra, "--", sys.executable, str(SCRIPT)]
    return warmstart.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**subprocess_env(), "EXIT_COUNT": str(out.parent / f"{out.name}.count"), **(env or {})})


def plan(*exits: tuple[int, str, str] | tuple[int, str, str, int]) -> dict[str, str]:
    """The script's EXITS: each (replica, when, how[, times]) ends that replica so (see the script)."""
    return {"EXITS": json.dumps({str(e[0]): {"when": e[1], "how": e[2], **({"times": e[3]} if len(e) > 3 else {})}
                                 for e in exits})}


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exits-ref") / "run"
    done = launch(out, replicas=1)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def finished_bitwise(done: subprocess.CompletedProcess[str], out: Path, reference: Path) -> list[dict]:
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["microbatches"] == M for r in rows)
    assert losses(out) == losses(reference)
    return rows


def test_replicas_that_exit_before_the_first_generation_are_left_behind_and_the_job_goes_on(
        reference: Path, tmp_path: Path) -> None:
    """Replica 1 exits with 2 and replica 2 by SIGSEGV before they register (no --rejoin-after): the first
    generation forms without them at the start timeout and the other two train every step."""
    out = tmp_path / "run"
    done = launch(out, replicas=4, env=plan((1, "start", "2"), (2, "start", "segv")))
    rows = finished_bitwise(done, out, reference)
    assert all(r["live_replicas"] == 2 for r in rows)
    ev = events(out)
    (timeout,) = [e for e in ev if e["kind"] == "start_timeout"]
    assert timeout["missing"] == [1, 2] and timeout["registered"] == [0, 3]
    for replica, code in ((1, 2), (2, -11)):
        assert [e["code"] for e in ev if e["kind"] == "replica_exit" and e["replica"] == replica] == [code]
        assert f"replica {replica} exited with {code}:" in done.stderr
        assert f"replica {replica}: ending itself" in done.stderr


ONCE = ((1, "start", "segv"), (2, "3", "1"), (3, "5", "2"), (4, "7", "segv"))
"""Each (replica, when, how) of the replaced-once run: before the first generation and mid-run, each status."""


def test_replicas_that_exit_once_are_replaced(reference: Path, tmp_path: Path) -> None:
    """Five replicas, four of which exit once (``ONCE``), with --rejoin-after 0: each is restarted, the one that
    exited before the first generation as one of its members, the others to join after their exits."""
    out = tmp_path / "run"
    # each step 0.15 s longer (changes no number): the steps after the last exit outlast the launcher's seeing it
    # and starting its replacement
    done = launch(out, "--rejoin-after", "0", replicas=5, start_timeout_s=120,
                  env={**plan(*((*e, 1) for e in ONCE)), "STEP_PAUSE_S": "0.15"})
    rows = finished_bitwise(done, out, reference)
    ev = events(out)
    for replica, when, how in ONCE:
        code = -11 if how == "segv" else int(how)
        exits = [e for e in ev if e["kind"] == "replica_exit" and e["replica"] == replica]
        assert exits[0]["code"] == code, exits
        restart, *again = [e for e in ev if e["kind"] == "rejoin_started" and e["replica"] == replica]
        assert restart["join"] == (when != "start") and len(again) < 3  # again: a joiner that met the job's end
        if when != "start":  # started to join after the exit (the job may end before it is started or in)
            assert exits[0]["t"] <= restart["t"]
    # restarted as one of the first generation's members
    assert not [e for e in ev if e["kind"] == "start_timeout"] and rows[0]["live_replicas"] == 5


def test_a_replica_that_fails_the_same_way_each_time_is_given_up_and_the_job_goes_on(
        reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # steps of 0.5 s (the script's own pause; changes no number): the job outlasts three new interpreters'
    # starts on a loaded machine (else it may end before the third exit, and nothing is left to give up)
    done = launch(out, "--rejoin-after", "0", env={**plan((2, "start", "1")), "STEP_PAUSE_S": "0.5"})
    rows = finished_bitwise(done, out, reference)
    assert all(r["live_replicas"] == 2 for r in rows)
    ev = events(out)
    assert [e["code"] for e in ev if e["kind"] == "replica_exit" and e["replica"] == 2] == [1, 1, 1]
    (given_up,) = [e for e in ev if e["kind"] == "replica_given_up"]
    assert given_up["replica"] == 2 and given_up["code"] == 1
    assert int((tmp_path / "run.count.2").read_text()) == 3


def test_too_few_replicas_left_to_start_end_the_job_with_one_line_naming_the_replica(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = launch(out, "--fault_tolerance.min_replicas=2", replicas=2, env=plan((1, "start", "2")), timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("recover: the job could not start: replica 1 exited with 2 before training began")
    assert str(out / "logs" / "replica_1.log") in last
    assert "replica 1: ending itself" in done.stderr  # the last lines of its log
    assert not (out / "metrics.jsonl").read_text()
    assert [e["kind"] for e in events(out)].count("start_failed") == 1


def test_replicas_of_another_release_are_refused_naming_both_versions_and_the_job_goes_on(
        reference: Path, tmp_path: Path) -> None:
    """Replica 1 runs another recover release, replica 2 speaks another wire protocol: each is refused at
    registration with one line naming both versions, and the other two train every step."""
    out = tmp_path / "run"
    done = launch(out, replicas=4, env=plan((1, "start", "release"), (2, "start", "wire")))
    rows = finished_bitwise(done, out, reference)
    assert all(r["live_replicas"] == 2 for r in rows)
    from recover.coord.protocol import PROTOCOL_VERSION as V

    release = (f"coordinator refused the request: bad_release: replica 1 runs recover 0.0.0-other (wire protocol "
               f"{V}), the coordinator recover 0.1.0 (wire protocol {V}): run one recover release on every host")
    wire = (f"coordinator refused the request: bad_version: the coordinator speaks wire protocol {V} (recover "
            f"0.1.0), replica 2 wire protocol {V + 1} (recover 0.1.0): run one recover release on every host")
    assert release in done.stderr and wire in done.stderr  # the launcher shows each replica's log's last lines
    assert "lost the coordinator" not in done.stderr
    assert sorted(e["code"] for e in events(out) if e["kind"] == "refused") == ["bad_release", "bad_version"]


def test_a_replica_whose_wall_clock_steps_an_hour_forward_moves_no_record(reference: Path, tmp_path: Path) -> None:
    """Replica 2's clock jumps +3600 s as step 4 begins: the step records stay the job's (ordered by its commits,
    timed by the launcher's monotonic clock), so ``elapsed_s`` grows by the run's own seconds, not by an hour."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    done = launch(out, env=plan((2, "4", "clock")))
    wall = time.monotonic() - t0
    rows = finished_bitwise(done, out, reference)
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and 0 < elapsed[-1] < wall
    assert all(r["replica"] == 2 for r in rows)  # one commit, several records: the higher replica's, as before


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A fresh memory cgroup limited to 400 MiB (v1 or v2), removed afterwards; skipped with the reason where
    the machine has none usable (no controller mounted, not root, a v2 tree without the memory controller)."""
    from recover.launch.oom import _mounts

    mounts = _mounts()
    root, limit_file = ((mounts["v1"], "memory.limit_in_bytes") if "v1" in mounts else
                        (mounts.get("v2"), "memory.max"))
    if root is None:
        pytest.skip("no memory cgroup controller is mounted (neither v1 nor v2)")
    if limit_file == "memory.max" and "memory" not in (root / "cgroup.subtree_control").read_text().split():
        pytest.skip(f"the cgroup v2 tree at {root} does not delegate the memory controller")
    cg = root / f"recover-oom-test-{os.getpid()}"
    try:
        cg.mkdir()
        (cg / limit_file).write_text(str(400 << 20))
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {root}: {exc.strerror} (needs root)")
    try:
        yield cg
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_replica_killed_by_the_oom_killer_is_named_out_of_memory_and_recovered_bitwise(
        reference: Path, tmp_path: Path, memory_cgroup: Path) -> None:
    out = tmp_path / "run"
    done = launch(out, "--device-time-s", "0.2", env={**plan((1, "5", "oom")), "OOM_CGROUP": str(memory_cgroup)})
    rows = finished_bitwise(done, out, reference)
    assert rows[4]["live_replicas"] == 3 and rows[-1]["live_replicas"] == 2
    (kill,) = [e for e in events(out) if e["kind"] == "kill"]
    assert kill["replica"] == 1 and kill["cause"] == "out of memory" and kill["peak_bytes"] > 50 << 20
    assert kill["cgroup"] == f"/{memory_cgroup.name}"
    line = [x for x in done.stderr.splitlines() if x.startswith("recover: replica 1 (PID ")]
    assert len(line) == 1 and "out of memory (the kernel's OOM killer, memory cgroup" in line[0], done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [(k["replica"], k["cgroup"]) for k in summary["out_of_memory"]] == [(1, f"/{memory_cgroup.name}")]
