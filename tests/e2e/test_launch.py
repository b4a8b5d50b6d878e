"""End to end: `recover launch` with real SIGKILLs, hangs and SIGSTOPs, compared with a failure-free reference run.

Every run uses 4 replicas of the `debug` preset for 24 steps on a mixture of two sources (weights 0.7
and 0.3: the session's corpus and a smaller slice of it). Each case checks that every committed step
holds all M microbatches and that the per-step loss stays within 1e-5 relative of the failure-free run,
and bitwise equal to it when both run in deterministic mode. (The failure-free reference runs in
deterministic mode; a default-mode run of the same job differs from it by ~1e-8.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warmstart
from conftest import NO_PLOTS, losses, max_rel_diff, refusal, run_recover, subprocess_env

STEPS = 24
M = 8
HANG_S = 2.0  # fault_tolerance.hang_timeout_s of the hang test (as the random hangs)


WEIGHTS = (0.7, 0.3)


def mixture(corpus: Path) -> list[str]:
    """The two sources every run here reads: the corpus and the slice beside it (:func:`second_source`)."""
    return ["--data.sources", f"{corpus}={WEIGHTS[0]},{corpus.parent / 'slice'}={WEIGHTS[1]}"]


@pytest.fixture(scope="module", autouse=True)
def second_source(corpus: Path) -> Path:
    from recover.data import prepare_builtin

    out = corpus.parent / "slice"
    prepare_builtin("stdlib", out, max_bytes=400_000, quiet=True)
    return out


def launch(out: Path, corpus: Path, *extra: str, check: bool = True, plots: bool = False):
    """``recover launch`` of this file's job; the run that draws its plots (the reference) is a new interpreter, as
    a user's (the others are forked warm: :mod:`warmstart`)."""
    return run_recover(["launch", *(() if plots else (NO_PLOTS,)), "--config", "debug", "--replicas", "4", "--steps",
                        str(STEPS), "--out", str(out), "--no-progress", *mixture(corpus), "--training.eval_every=20",
                        *extra], timeout=300, check=check, fresh=plots)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def every_step_bitwise(run: Path, reference: Path) -> list[dict]:
    """The run's step records, once checked: every step committed with all M microbatches, each loss bitwise
    equal to the failure-free ``reference``'s."""
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    assert losses(run) == losses(reference)
    return recs


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_det(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("launch-ref-det")
    launch(out, corpus, "--deterministic", plots=True)
    return out


def check_run(run: Path, ref: Path, bitwise: bool, kills: int) -> dict:
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert all(r["microbatches"] == M for r in recs)
    run_losses, ref_losses = losses(run), losses(ref)
    if bitwise:
        assert run_losses == ref_losses
    else:
        assert max_rel_diff(ref_losses, run_losses) <= 1e-5
    ev = events(run)
    assert sum(e["kind"] == "kill" for e in ev) == kills
    summary = json.loads((run / "summary.json").read_text())
    assert summary["committed_steps"] == STEPS and summary["min_microbatches"] == M
    assert len(summary["recoveries"]) >= 1
    assert not list(run.glob("*.png"))  # observe.plots = false: none drawn
    return summary


def test_reference_is_failure_free_and_matches_plain_training(reference_det: Path, corpus: Path,
                                                               tmp_path: Path) -> None:
    assert all(r["live_replicas"] == 4 and r["microbatches"] == M for r in rows(reference_det))
    assert all((reference_det / name).stat().st_size > 10_000 for name in ("loss.png", "throughput.png", "goodput.png"))
    forks = [e for e in events(reference_det) if e["kind"] == "fork_server"]  # its processes were forked:
    assert [(e["forks"], e["forked"]) for e in forks] == [(True, 5)]  # the coordinator and the 4 workers
    run_recover(["train", "--config", "debug", "--out", str(tmp_path), "--no-progress", *mixture(corpus),
                 f"--training.steps={STEPS}", "--training.eval_every=20"])
    assert max_rel_diff(losses(tmp_path), losses(reference_det)) <= 1e-5
    # the sources' tokens of committed steps follow the weights (stratified: within a row or two)
    for rec in rows(reference_det):
        counts = list(rec["source_tokens"].values())
        assert sum(counts) == rec["total_tokens"]
        assert abs(counts[1] - WEIGHTS[1] * rec["total_tokens"]) <= 2 * 64  # debug: seq_len 64
    g = json.loads((tmp_path / "summary.json").read_text())["goodput"]  # recover train reports it too
    assert 0 < g["ettr"] <= 1 and g["tokens_committed"] == sum(r["tokens"] for r in rows(tmp_path))


def test_compute_phase_failures_down_to_one_replica_deterministic(reference_det: Path, corpus: Path,
                                                                   tmp_path: Path) -> None:
    """With the reduction overlapping each last backward (on, whatever the device; 10 KB buckets, so many
    are in flight when the kills land), bitwise equal to the reference, which reduces after it."""
    launch(tmp_path, corpus, "--deterministic", "--fail", "1@2:forward", "--fail", "2@5:backward",
           "--fail", "3@8:reduce", "--fault_tolerance.overlap_reduction=on", "--fault_tolerance.bucket_mb=0.01")
    check_run(tmp_path, reference_det, bitwise=True, kills=3)
    live = {r["step"]: r["live_replicas"] for r in rows(tmp_path)}
    assert live[1] == 4 and live[2] == 3 and live[5] == 2 and live[8] == 1 and live[STEPS - 1] == 1


def test_commit_optimizer_idle_failures(reference_det: Path, corpus: Path, tmp_path: Path) -> None:
    launch(tmp_path, corpus, "--fail", "1@2:commit", "--fail", "2@5:optimizer", "--fail", "3@8:idle")
    check_run(tmp_path, reference_det, bitwise=False, kills=3)
    live = {r["step"]: r["live_replicas"] for r in rows(tmp_path)}
    assert live[STEPS - 1] == 1
    (forks,) = [e for e in events(tmp_path) if e["kind"] == "fork_server"]
    assert forks["forks"] and forks["forked"] == 5  # the coordinator and the 4 workers
    if warmstart.warm([sys.executable, "-m", "recover"], subprocess_env()):  # forked warm: it adopted the server
        assert forks["cpu_s"] < 1.0  # handed to it, which imported nothing (one started anew spends ~3 s)


def test_two_at_once_then_a_failure_during_recovery(reference_det: Path, corpus: Path, tmp_path: Path) -> None:
    launch(tmp_path, corpus, "--deterministic", "--fail", "1@3:backward", "--fail", "2@3:backward",
           "--fail", "3@3:recover")
    check_run(tmp_path, reference_det, bitwise=True, kills=3)
    recs = rows(tmp_path)
    assert recs[3]["live_replicas"] == 1 and recs[2]["live_replicas"] == 4


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fail", "1@3:lunch"], "phase 'lunch' is not a phase"),
        (["--fail", "1@99:forward"], "step 99 is beyond the run"),
        (["--fail", "7@3:forward"], "replica 7 does not exist; replicas are 0..3"),
        (["--fail", "0@1", "--fail", "1@2", "--fail", "2@3", "--fail", "3@4"], "kill at most 3"),
        (["--pp", "2"], "(--model.tie_embeddings false)"),
        (["--tp", "2", "--procs-per-replica", "3"], "does not match pp x tp x fsdp = 1 x 2 x 1 = 2"),
        (["--fsdp", "2", "--fail", "1@3", "--fail-rank", "2"], "--fail-rank 2 is not allowed: a replica has ranks 0"),
        (["--tp", "3"], "parallel.tp = 3 is not allowed"),
        (["--tp", "2", "--baseline", "shrink"], "runs one process per replica"),
    ],
)
def test_impossible_requests_are_refused_before_starting(corpus: Path, tmp_path: Path, flags: list[str],
                                                         message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = refusal(["launch", "--config", "debug", "--replicas", "4", "--steps", str(STEPS), "--out",
                         str(tmp_path / "run"), "--no-progress", "--data.path", str(corpus), *flags], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run" / "events.jsonl").exists()  # nothing was started


@pytest.mark.parametrize("damage", ["magic", "truncated", "vocabulary"])
def test_bad_shards_are_refused_before_anything_starts(corpus: Path, tmp_path: Path, damage: str) -> None:
    """A damaged llm.c magic, a validation shard cut to 100 bytes, or token ids beyond the model's
    vocabulary (as `recover prepare --verify` recorded them): one line naming the shard and the real problem,
    in seconds, and no process started."""
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    train, val = data / "train_000000.bin", data / "val_000000.bin"
    if damage == "magic":
        raw = bytearray(train.read_bytes())
        raw[0:4] = (4242).to_bytes(4, "little")
        train.write_bytes(bytes(raw))
    elif damage == "truncated":
        val.write_bytes(val.read_bytes()[:100])
    else:  # without meta.json (whose 257 would refuse --model.vocab_size 256 first), the ids `prepare --verify`
        (data / "meta.json").unlink()  # recorded are checked (launch itself reads no token)
        res = run_recover(["prepare", "--verify", str(data), "--quiet"])
        assert "largest token id 256" in res.stdout and (data / ".recover-verified.json").is_file()
    t0 = time.monotonic()
    res = run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "2", "--out", str(tmp_path / "run"),
                       "--no-progress", "--data.path", str(data),
                       *(["--model.vocab_size=256"] if damage == "vocabulary" else [])], check=False)
    assert time.monotonic() - t0 < 5 and res.returncode == 2
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    expected = {"magic": ("train_000000.bin", "damaged llm.c header: magic 4242"),
                "truncated": ("val_000000.bin", "truncated llm.c shard: 100 bytes"),
                "vocabulary": ("train_000000.bin", "out of range for vocab_size 256")}[damage]
    assert all(text in line for text in expected), line
    assert (damage == "vocabulary") == ("vocab_size" in line)  # a bad header is never a vocabulary problem
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_compare_exits_nonzero_above_tolerance(reference_det: Path, tmp_path: Path) -> None:
    ok = run_recover(["compare", str(reference_det), str(reference_det), "--tol", "1e-5"])
    assert "bitwise equal" in ok.stdout and "OK" in ok.stdout
    other = tmp_path / "other"
    other.mkdir()
    recs = rows(reference_det)
    recs[5]["loss"] *= 1.01
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    bad = run_recover(["compare", str(reference_det), str(other), "--tol", "1e-5"], check=False)
    assert bad.returncode == 1 and "at step 5" in bad.stdout


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_hangs_in_forward_backward_and_reduce_then_the_lone_survivors_are_fenced_and_recovered(
        reference_det: Path, corpus: Path, tmp_path: Path) -> None:
    """A training thread stopped for good (process and heartbeats alive) is fenced for its lack of
    progress within hang_timeout_s + 1 s; the survivors recover in-step as from a crash. Replica 0, alone
    from step 8, hangs in step 13 (nobody waits for it): fenced all the same; the replica started in its
    place finds nobody holding the state, restores the checkpoint of step 12 and trains to the end, the
    injected hang not striking again."""
    launch(tmp_path, corpus, "--deterministic", "--hang", "1@2:forward", "--hang", "2@5:backward",
           "--hang", "3@8:reduce", "--hang", "0@13:forward", f"--fault_tolerance.hang_timeout_s={HANG_S}",
           "--rejoin-after", "0", "--rejoin-replicas", "0", "--training.checkpoint_every=4")
    check_run(tmp_path, reference_det, bitwise=True, kills=4)
    ev = events(tmp_path)
    restored, = (e for e in ev if e["kind"] == "restored")
    assert (restored["replica"], restored["step"], restored["redo"]) == (0, 12, 1)
    for r in (0, 1, 2, 3):
        hang = next(e for e in ev if e["kind"] == "kill" and e["replica"] == r)
        fenced = next(e for e in ev if e["kind"] == "failure_detected" and e["replica"] == r)
        assert hang["fault"] == "hang" and fenced["cause"] == "hung"
        assert fenced["t"] - hang["t"] <= HANG_S + 1.0
        assert any(e["kind"] == "replica_exit" and e["replica"] == r and e["code"] == -9 for e in ev)
        assert gone(hang["pid"])  # nothing left running
    live = {r["step"]: r["live_replicas"] for r in rows(tmp_path)}
    assert live[1] == 4 and live[2] == 3 and live[5] == 2 and live[8] == 1 and live[STEPS - 1] == 1
    # goodput: the three hangs' detection is time lost to recovery, the lone one's and its restore to restart;
    # each fault in the summary and the report
    summary = json.loads((tmp_path / "summary.json").read_text())
    g = summary["goodput"]
    assert 0 < g["ettr"] < g["ettr_after_startup"] <= 1 and g["committed_steps"] == STEPS
    assert g["tokens_committed"] == sum(r["tokens"] for r in rows(tmp_path))
    assert 3 * (HANG_S - 0.5) <= g["lost_s"]["recovery"] <= 3 * (HANG_S + 2.5) and g["lost_s"]["startup"] > 0
    assert g["lost_s"]["restart"] >= HANG_S
    assert g["useful_s"] + sum(g["lost_s"].values()) == pytest.approx(g["wall_s"], abs=0.01)
    assert [(f["fault"], f["replica"], f["detected_by"]) for f in summary["faults"]] == \
        [("hang", 1, "hung"), ("hang", 2, "hung"), ("hang", 3, "hung"), ("hang", 0, "hung")]
    assert all(HANG_S * 1000 <= f["detection_ms"] <= (HANG_S + 1) * 1000 for f in summary["faults"])
    for png in tmp_path.glob("*.png"):
        png.unlink()
    report = run_recover(["report", str(tmp_path), "--reference", str(reference_det)])
    assert "goodput (effective training time ratio)" in report.stdout and "lost: recovery" in report.stdout
    said = " ".join(report.stdout.split())  # rich wraps at the terminal's width, wherever the paths end
    assert "hung" in said and "(bitwise equal)" in said
    assert all((tmp_path / name).stat().st_size > 0 for name in ("loss.png", "throughput.png", "goodput.png"))


SECRET_LIKE = re.compile(r"\b[0-9a-f]{32}\b")


def _stranger_writes(host: str, store_port: int) -> int:
    """What a stranger on the store port does: every old name of the next generations forged, every entry it
    lists overwritten. Returns how many entries it listed."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(host, store_port, None, False, timedelta(seconds=30))  # patient: the cores are shared
    listed = store.list_keys()
    for name in listed:
        store.set(name, "127.0.0.1:1")
    for g in range(1, 8):
        for r in range(4):
            store.set(f"gen{g}/0/{r}", "127.0.0.1:1")
            store.set(f"gen{g}/probe/{r}", "127.0.0.1:1")
    return len(listed)


def _stranger_registers(host: str, port: int) -> dict:
    """A register without the token: the coordinator's answer."""
    import socket

    from recover.coord.protocol import FrameDecoder, encode

    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(encode({"type": "register", "id": 1, "token": "guessed", "replica": 0, "join": True}))
        decoder = FrameDecoder()
        while True:
            got = decoder.feed(sock.recv(1 << 16))
            if got:
                return got[0]


def _coordinator_start(run: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> dict:
    """The coordinator's ``coordinator_start`` event, once it is in ``events.jsonl``."""
    deadline = time.monotonic() + timeout
    while True:
        path = run / "events.jsonl"
        found = [e for e in events(run) if e["kind"] == "coordinator_start"] if path.exists() else []
        if found:
            return found[0]
        assert time.monotonic() < deadline and proc.poll() is None, "the coordinator never started"
        time.sleep(0.05)


def test_intruders_and_every_replica_killed_at_once_leave_the_run_bitwise_unaffected(
        reference_det: Path, corpus: Path, tmp_path: Path) -> None:
    """While the job trains: a stranger without the token lists the coordinator's store, forges every key a
    generation's group used to read in the clear for the generations to come, overwrites every entry it lists
    and tries to register (refused); a holder of the token starts `recover worker` with a replica id beyond
    --max-replicas (refused in one line, exit 2). Then all four replicas are SIGKILLed at the same moment from
    outside: their replacements come from the warm pool (two spares started with the job, then those started
    behind them), find nobody holding the state, the first back (one spare, or both when they register
    together) restore the newest complete checkpoint, the others take its state as they come. Exit 0, every
    step bitwise equal to the failure-free run, nothing the job logs holds a generation's secret, and no
    process (spares included) outlives the launcher."""
    run = tmp_path / "run"
    proc = _start_launch(run, corpus, "--rejoin-after", "0", "--training.checkpoint_every=4", "--device-time-s", "0.2",
                         "--warm-spares", "2")
    extra = None
    try:
        start = _coordinator_start(run, proc)
        assert start["max_replicas"] == 4
        extra = warmstart.popen([sys.executable, "-m", "recover", "worker", "--config", str(run / "config.json"),
                                  "--out", str(tmp_path / "extra"), "--coordinator", f"127.0.0.1:{start['port']}",
                                  "--token-file", str(run / "token"), "--replica", "4", "--join"],
                                 env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _await_step(run, 2, proc)
        assert _stranger_writes("127.0.0.1", start["store_port"]) > 0
        reply = _stranger_registers("127.0.0.1", start["port"])
        assert reply["type"] == "error" and reply["code"] == "unauthorized", reply
        _await_step(run, 10, proc)  # the extra worker's refusal is read at the end: its start-up takes its time
        for pid in [_worker_pid(run, r) for r in range(4)]:  # gathered first, then killed at once
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]
        _, said = extra.communicate(timeout=120)
        assert extra.returncode == 2, said
        assert said.strip().splitlines() == [
            "recover: error: coordinator refused the request: bad_replica: replica id 4 is outside this job's "
            "0..3 (--max-replicas lets it grow)"]
        assert _processes_of(run) == {}  # the launcher reaped every replica and spare before it exited
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
            extra.wait(10)
        _reap(run, proc)
    every_step_bitwise(run, reference_det)
    ev = events(run)
    assert {e["code"] for e in ev if e["kind"] == "refused"} == {"unauthorized", "bad_replica"}
    # (a joiner admitted at the last commit, left alone as the others finish, restores the final checkpoint)
    restored = [e for e in ev if e["kind"] == "restored" and e["step"] < STEPS]
    assert len(restored) in (1, 2) and len({(e["generation"], e["step"]) for e in restored}) == 1  # one checkpoint
    assert restored[0]["step"] % 4 == 0 and 8 <= restored[0]["step"] < STEPS
    after = [e for e in ev if e["kind"] == "state_received" and e["t"] > restored[-1]["t"]]
    assert after and all(e["step"] > restored[0]["step"] for e in after)  # the others took the restored state
    assert sorted(e["replica"] for e in ev if e["kind"] == "failure_detected") == [0, 1, 2, 3]  # the kills alone
    assert json.loads((run / "summary.json").read_text())["kills"] == 4
    rejoins = [e for e in ev if e["kind"] == "rejoin_started"]
    assert sorted(e["replica"] for e in rejoins) == [0, 1, 2, 3]
    trained = next(e["t"] for e in ev if e["kind"] == "commit")
    assert [e["log"] for e in rejoins][:2] == ["spare_0.log", "spare_1.log"]  # the oldest spares first,
    assert all(e["t"] - e["spare_waited_s"] < trained for e in rejoins[:2])  # both started with the job
    assert all(e["log"].startswith("spare_") for e in rejoins) and not any(e["kind"] == "spare_exit" for e in ev)
    for text in [(run / "events.jsonl").read_text(), *(p.read_text() for p in (run / "logs").glob("*.log"))]:
        assert not SECRET_LIKE.search(text), SECRET_LIKE.search(text)


def test_a_straggler_gets_fewer_microbatches_without_changing_the_trajectory(reference_det: Path, corpus: Path,
                                                                             tmp_path: Path) -> None:
    """Replica 3's microbatches take 4x as long from step 3 (emulated devices): the agreed speeds name
    it and move its work to the others; every step still holds all M, bitwise equal to the reference."""
    launch(tmp_path, corpus, "--deterministic", "--slow", "3@3:4", "--device-time-s", "0.05")
    recs = every_step_bitwise(tmp_path, reference_det)
    ev = events(tmp_path)
    named = next(e for e in ev if e["kind"] == "straggler")
    assert named["replica"] == 3 and named["slowdown"] >= 1.5 and not any(e["kind"] == "kill" for e in ev)
    assert recs[2].get("quotas") is None  # before the slow-down: the even split
    late = [r["quotas"]["3"] for r in recs[10:]]
    assert max(late) <= 1 and all(sum(r["quotas"].values()) == M for r in recs[10:])
    assert all(r["stragglers"] == {"3": pytest.approx(4, rel=0.2)} for r in recs[10:20])
    g = json.loads((tmp_path / "summary.json").read_text())["goodput"]
    assert g["lost_s"]["stragglers"] > 0 and g["lost_s"]["recovery"] == 0


def test_random_hangs_sent_from_outside_are_fenced_reaped_and_rejoined(reference_det: Path, corpus: Path,
                                                                       tmp_path: Path) -> None:
    """--random-faults hang: the launcher stops a random replica's training thread (SIGUSR1, not the
    worker's own injector) at random moments; the progress rule finds it, the replica is fenced,
    exits or is reaped, and rejoins; the run stays bitwise equal to the failure-free one."""
    launch(tmp_path, corpus, "--deterministic", "--random-failures", "1.0", "--random-faults", "hang",
           "--rejoin-after", "0", "--device-time-s", "0.05", "--fault_tolerance.hang_timeout_s=2")
    every_step_bitwise(tmp_path, reference_det)
    ev = events(tmp_path)
    hangs = [e for e in ev if e["kind"] == "kill"]
    assert hangs and all(e["fault"] == "hang" and e["source"] == "launcher" for e in hangs)
    for hang in hangs:
        fenced = next(e for e in ev if e["kind"] == "failure_detected" and e["replica"] == hang["replica"]
                      and e["t"] > hang["t"])
        assert fenced["cause"] == "hung" and gone(hang["pid"])


def test_a_replica_stuck_after_the_last_step_is_stopped_after_the_grace(corpus: Path, tmp_path: Path) -> None:
    """Replica 1's training thread hangs after the last commit (no peer is left to notice): every step
    is committed, so the launcher gives it fault_tolerance.stop_grace_s to exit, then kills it; exit 0."""
    res = run_recover(["launch", NO_PLOTS,
                       "--config", "debug", "--replicas", "2", "--steps", "3", "--out", str(tmp_path),
                       "--no-progress", "--data.path", str(corpus), "--hang", "1@2:idle",
                       "--fault_tolerance.stop_grace_s=1"], timeout=120)
    assert res.returncode == 0 and [r["step"] for r in rows(tmp_path)] == [0, 1, 2]
    ev = events(tmp_path)
    stuck = next(e for e in ev if e["kind"] == "kill")
    assert stuck["replica"] == 1 and gone(stuck["pid"])
    assert [e["running"] for e in ev if e["kind"] == "exit_grace_over"] == [[1]]


def test_a_broken_link_between_two_replicas_fences_one_of_them_never_the_same_generation(
        reference_det: Path, corpus: Path, tmp_path: Path) -> None:
    """--cut 1@5:2: from step 5 replicas 1 and 2 cannot reach each other; every member reaches the
    all-reduce, which times out; the reports name who could not reach whom, the coordinator fences
    the implicated replica, and the survivors recover in-step, bitwise equal to the reference."""
    launch(tmp_path, corpus, "--deterministic", "--cut", "1@5:2", "--device-time-s", "0.05",
           "--fault_tolerance.collective_timeout_s=3")
    every_step_bitwise(tmp_path, reference_det)
    ev = events(tmp_path)
    report = next(e for e in ev if e["kind"] == "link_report")
    assert report["unreachable"]["1"] == [2] and report["unreachable"]["2"] == [1]
    assert report["unreachable"]["0"] == [] and report["fenced"] == [2] and report["broken"] == [[1, 2]]
    assert [(e["replica"], e["cause"]) for e in ev if e["kind"] == "failure_detected" and e["cause"] != "left"] \
        == [(2, "link")]
    generations = [e for e in ev if e["kind"] == "generation" and e["reason"] != "initial" and e["step"] < STEPS]
    assert [g["members"] for g in generations] == [[0, 1, 3]]  # one new generation, not the same members again


def _processes_of(run: Path) -> dict[int, str]:
    """The command line (spaces between arguments) of each live process that names ``run`` (the launcher's
    coordinator and workers), by PID; read once, so a process that exits meanwhile is simply left out."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run) in cmdline and int(entry.name) != os.getpid():
                processes[int(entry.name)] = cmdline
    return processes


def test_every_process_dies_with_a_sigkilled_launcher(corpus: Path, tmp_path: Path) -> None:
    """SIGKILL of `recover launch` (no cleanup possible: the kernel ends its children) leaves nothing running.
    The launcher is a new interpreter, its fork server too (the one started as in a user's job)."""
    sig = signal.SIGKILL
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "recover", "launch", NO_PLOTS,
                             "--config", "debug", "--replicas", "3",
                             "--steps", "500", "--out", str(run), "--no-progress", "--data.path", str(corpus),
                             "--device-time-s", "0.05", "--rejoin-after", "0"],
                            env=subprocess_env(), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.2)
        children = [p for p in _processes_of(run) if p != proc.pid]
        assert len(children) >= 4  # the coordinator, 3 replicas (and a spare)
        os.kill(proc.pid, sig)
        proc.wait(30)
        deadline = time.monotonic() + 5
        while _processes_of(run) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_of(run) == {}
    finally:
        for pid in [proc.pid, *_processes_of(run)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _await_step(run: Path, step: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """Waits until a replica of ``run`` logged a record of ``step``."""
    deadline = time.monotonic() + timeout
    while not any(f'"step":{step},' in p.read_text() for p in (run / "replicas").glob("replica_*.jsonl")):
        assert time.monotonic() < deadline and proc.poll() is None, f"step {step} never came"
        time.sleep(0.05)


def _coordinator_pid(run: Path) -> int:
    pids = [p for p, cmdline in _processes_of(run).items() if " coordinator " in cmdline]
    assert len(pids) == 1, pids
    return pids[0]


def _start_launch(run: Path, corpus: Path, *extra: str) -> subprocess.Popen[bytes]:
    return warmstart.popen([sys.executable, "-m", "recover", "launch", NO_PLOTS,
                             "--config", "debug", "--replicas", "4",
                             "--steps", str(STEPS), "--out", str(run), "--no-progress", *mixture(corpus),
                             "--training.eval_every=20", "--deterministic", "--device-time-s", "0.05", *extra],
                            env=subprocess_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _reap(run: Path, proc: subprocess.Popen[bytes]) -> None:
    for pid in [proc.pid, *_processes_of(run)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def test_the_coordinator_killed_mid_commit_paused_and_killed_again_costs_no_step(reference_det: Path,
                                                                                 corpus: Path, tmp_path: Path) -> None:
    """The coordinator SIGKILLs itself in step 8's commit after one of its four replies went out (that
    replica applied step 8, the others did not), is SIGSTOPped for 3 s later on (three times its heartbeat
    timeout), then SIGKILLed from outside: each time the launcher restarts it, the replicas keep their
    state and register again, the ones behind take the state of the one ahead. Then a replica is
    SIGKILLed from outside: counted as a kill, recovered in-step. Every step is committed once with M
    microbatches, bitwise equal to the failure-free run, exit 0, nothing left running."""
    run = tmp_path / "run"
    proc = _start_launch(run, corpus, "--kill-coordinator", "8:1")
    try:
        _await_step(run, 12, proc)
        paused = _coordinator_pid(run)
        os.kill(paused, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(paused, signal.SIGCONT)
        _await_step(run, 16, proc)
        os.kill(_coordinator_pid(run), signal.SIGKILL)
        _await_step(run, 19, proc)  # and a replica killed from outside, once the coordinator is back
        os.kill(_worker_pid(run, 3), signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]
        deadline = time.monotonic() + 5
        while _processes_of(run) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_of(run) == {}
    finally:
        _reap(run, proc)
    every_step_bitwise(run, reference_det)
    ev = events(run)
    assert [e["code"] for e in ev if e["kind"] == "coordinator_exit"] == [-9, -9]
    rebuilt = [e for e in ev if e["kind"] == "rebuilt"]
    assert len(rebuilt) == 2 and rebuilt[0]["committed_step"] == 8 and len(rebuilt[0]["behind"]) == 3
    assert {e["replica"] for e in ev if e["kind"] == "resynced"} == {0, 1, 2, 3}
    assert any(e["kind"] == "coordinator_stalled" and e["seconds"] > 2.5 for e in ev)
    # the kill is seen by the launcher's death watch, before the worker's connection closes
    assert [(e["replica"], e["cause"]) for e in ev if e["kind"] == "failure_detected"] == [(3, "process_died")]
    assert not [e for e in ev if e["kind"] in ("fenced", "quorum_lost")]  # nobody paid for the coordinator
    summary = json.loads((run / "summary.json").read_text())
    assert summary["kills"] == 1 and summary["coordinator_restarts"] == 2 and summary["recoveries"][0]["replica"] == 3
    assert 0 < summary["recovery_latency_ms_max"] < 5000


def test_sigterm_to_the_launcher_saves_a_checkpoint_and_resume_finishes_bitwise(reference_det: Path,
                                                                                corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _start_launch(run, corpus)
    try:
        _await_step(run, 8, proc)
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 6, err.decode()[-3000:]
        while _processes_of(run) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert _processes_of(run) == {}
        assert "continue with the same command and --resume" in err.decode()
    finally:
        _reap(run, proc)
    stopped_at = len(rows(run))
    assert 8 < stopped_at < STEPS and (run / "checkpoints" / f"step_{stopped_at:06d}").is_dir()
    assert [e["replica"] for e in events(run) if e["kind"] == "stopped"] != []
    refused = launch(run, corpus, "--deterministic", check=False)  # neither --resume nor --overwrite
    assert refused.returncode == 2 and "holds another run" in refused.stderr and "--resume" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and len(rows(run)) == stopped_at  # nothing touched
    launch(run, corpus, "--deterministic", "--resume")
    every_step_bitwise(run, reference_det)


def _worker_pid(run: Path, replica: int) -> int:
    """The PID of replica ``replica``'s worker process (one rank)."""
    pattern = re.compile(rf" worker .*--replica {replica}( |$)")
    pids = [p for p, cmdline in _processes_of(run).items() if pattern.search(cmdline)]
    assert len(pids) == 1, pids
    return pids[0]


def test_sigterm_to_one_worker_is_a_graceful_leave_and_the_others_finish_bitwise(reference_det: Path,
                                                                                 corpus: Path, tmp_path: Path) -> None:
    """SIGTERM to replica 2's worker (a preempted node) at step ~15: it leaves at the next commit, exits 0
    and saves nothing; the other three go on in a generation formed without it (no failure round, no
    recompute, no microbatch lost), the job finishes every step bitwise equal to the failure-free run, exit 0."""
    run = tmp_path / "run"
    proc = _start_launch(run, corpus)
    try:
        _await_step(run, 14, proc)
        os.kill(_worker_pid(run, 2), signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        _reap(run, proc)
    recs = every_step_bitwise(run, reference_det)
    ev = events(run)
    (leave,) = [e for e in ev if e["kind"] == "leave"]
    assert leave["replicas"] == [2] and 14 <= leave["step"] < STEPS - 1
    assert [r["live_replicas"] for r in recs if r["step"] > leave["step"]] == [3] * (STEPS - 1 - leave["step"])
    (gen,) = [e for e in ev if e["kind"] == "generation" and e["reason"] == "leave"]
    assert gen["members"] == [0, 1, 3] and gen["dead"] == [2] and gen["step"] == leave["step"] + 1
    assert not [e for e in ev if e["kind"] in ("failure_detected", "stop_requested", "stop", "kill")]
    assert all(e["reason"].endswith(": left") and e["generation"] >= gen["generation"] and "replica 2" not in
               e["reason"] for e in ev if e["kind"] == "failing")  # only the goodbyes at the end
    assert [e["code"] for e in ev if e["kind"] == "replica_exit" and e["replica"] == 2] == [0]
    assert [e["step"] for e in ev if e["kind"] == "left" and e.get("replica") == 2 and "step" in e] \
        == [leave["step"] + 1]


def test_a_corrupted_replica_and_a_nan_are_found_and_healed_in_their_step(reference_det: Path, corpus: Path,
                                                                          tmp_path: Path) -> None:
    """One bit of replica 2's parameters flips before step 8 (nothing crashes): its fingerprint differs
    from the other three at step 8's vote, it is fenced as divergent, the others recompute its
    microbatches in that step, and it rejoins with their state. At step 16 the gradient of microbatch 2
    is NaN on replica 1: never folded, replica 1 fenced, microbatch 2 recomputed elsewhere. Every step
    holds M microbatches, bitwise equal to the failure-free run (neither is counted as a kill)."""
    launch(tmp_path, corpus, "--deterministic", "--corrupt", "2@8", "--nan", "1@16:2", "--rejoin-after", "0",
           "--device-time-s", "0.02", "--workload.policy=even")
    every_step_bitwise(tmp_path, reference_det)
    ev = events(tmp_path)
    divergent = [e for e in ev if e["kind"] == "divergent"]
    assert [(d["step"], d["replicas"], d["majority"]) for d in divergent] == [(8, [2], [0, 1, 3])]
    assert [(e["replica"], e["step"], e["ids"]) for e in ev if e["kind"] == "nonfinite" and "generation" in e] \
        == [(1, 16, [2])]
    assert 2 in [e["replica"] for e in ev if e["kind"] == "state_received"]  # it came back with their state
    assert not any(e["kind"] == "kill" for e in ev)
    # corrupted arithmetic, parameters intact (every replica applies the same reduced gradient): only the
    # audit sees it; replica 1 owns the audited microbatch of step 0 with 3 replicas (seed 1234)
    audited = tmp_path / "audited"
    launch(audited, corpus, "--replicas", "3", "--deterministic", "--miscompute", "1@0",
           "--fault_tolerance.audit_every=1", "--workload.policy=even")
    assert losses(audited) == losses(reference_det) and all(r["microbatches"] == M for r in rows(audited))
    audits = [e for e in events(audited) if e["kind"] == "audit"]
    assert [(a["step"], a["replicas"], a["majority"]) for a in audits] == [(0, [1], [0, 2])]


def test_nan_everywhere_and_a_two_replica_split_stop_the_job_with_their_state_saved(corpus: Path,
                                                                                   tmp_path: Path) -> None:
    """The same microbatch NaN on every replica is a true divergence: exit 9, the step and the id named,
    the last committed state saved. Two replicas whose parameters disagree have no majority: exit 8, each
    side's state saved under checkpoints/diverged/, the run's own checkpoints untouched."""
    nan = tmp_path / "nan"
    res = launch(nan, corpus, "--deterministic", "--workload.policy=even",
                 *(a for r in range(4) for a in ("--nan", f"{r}@6:2")), check=False)
    assert res.returncode == 9, res.stderr[-2000:]
    named = re.search(r"microbatch 2 of step 6 was not finite on replicas \[(\d), (\d)\]: the training diverged",
                      res.stderr)
    assert named is not None and len(set(named.groups())) == 2, res.stderr  # its owner, then the one it went to
    assert [p.name for p in (nan / "checkpoints").iterdir()] == ["step_000006"]

    split = tmp_path / "split"
    res = run_recover(["launch", NO_PLOTS,
                       "--config", "debug", "--replicas", "2", "--steps", str(STEPS), "--out", str(split),
                       "--no-progress", "--data.path", str(corpus), "--deterministic", "--corrupt", "1@5",
                       "--training.checkpoint_every=2", "--training.eval_every=0"], timeout=300, check=False)
    assert res.returncode == 8, res.stderr[-2000:]
    assert "disagree at step 5 with no majority to trust (replicas [0] hold" in res.stderr
    ckpts = split / "checkpoints"
    saved = [e["step"] for e in events(split) if e["kind"] == "checkpoint"]  # step 4's is skipped while step 2's
    assert saved in ([2], [2, 4])  # is still being written (a loaded machine): never a torn or a diverged one
    assert sorted(p.name for p in ckpts.iterdir()) == ["diverged", *(f"step_{s:06d}" for s in saved)]
    sides = sorted((ckpts / "diverged").iterdir())
    assert [p.name for p in sides] == ["replicas_0", "replicas_1"]
    manifests = [json.loads((p / "step_000005" / "manifest.json").read_text())["files"] for p in sides]
    assert manifests[0] != manifests[1]  # two different states, each kept whole


def test_a_token_id_beyond_the_vocabulary_met_in_training_stops_the_job_with_its_state_saved(corpus: Path,
                                                                                              tmp_path: Path) -> None:
    """Data that records no largest id (as llm.c's and nanoGPT's come) is not scanned at launch; the first
    microbatch holding an id beyond the vocabulary (here one row of step 3) stops the job in that step:
    exit 10, one line naming the file, the offset and the id, and steps 0-2 saved, whoever met it."""
    import numpy as np

    from recover.data.sampler import Sampler
    from recover.data.shards import TokenDataset

    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("max_id", "shard_info")}))
    train = TokenDataset(data / "train_*.bin")
    sampler = Sampler(train, 64, 2, M, seed=1234)  # the debug preset's data and seed
    early = {int(w) for step in range(3) for mb in range(M) for w in sampler.window_ids(step, mb)}
    window = next(int(w) for w in sampler.window_ids(3, 5) if int(w) not in early)
    shard = train.paths[0]
    assert len(train.paths) == 1 and (window + 1) * 64 < len(train)
    offset = window * 64 + 10
    tokens = np.memmap(shard, dtype="<u2", mode="r+", offset=1024)
    tokens[offset] = 1000  # the model has 320 ids
    tokens.flush()
    del tokens
    run = tmp_path / "run"
    res = run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "2", "--steps", "8", "--out", str(run),
                       "--no-progress", "--data.path", str(data), "--deterministic"], timeout=300, check=False)
    assert res.returncode == 10, res.stderr[-2000:]
    assert f"{shard.name}: token id 1000 at position {offset} (byte {1024 + 2 * offset}) is out of range for " \
           "vocab_size 320" in res.stderr
    assert "Traceback" not in res.stderr
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000003"]


def test_bfloat16_compute_survives_a_kill_and_stays_near_float32(reference_det: Path, corpus: Path,
                                                                 tmp_path: Path) -> None:
    launch(tmp_path, corpus, "--deterministic", "--training.dtype=bfloat16", "--fail", "2@10:backward")
    recs = rows(tmp_path)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    assert recs[10]["live_replicas"] == 3
    ref = losses(reference_det)[STEPS - 1]
    assert recs[-1]["loss"] != ref and abs(recs[-1]["loss"] - ref) <= 0.03 * ref  # bf16 arithmetic, near fp32


def _await_record(run: Path, replica: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """Waits until replica ``replica`` logged a step record of its own (it trains as a member)."""
    path, deadline = run / "replicas" / f"replica_{replica}.jsonl", time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, f"replica {replica} never trained"
        time.sleep(0.05)


def test_a_fifth_replica_started_by_hand_joins_and_a_drained_one_leaves_both_bitwise(
        reference_det: Path, corpus: Path, tmp_path: Path) -> None:
    """`recover launch --replicas 4 --max-replicas 5`, then a fifth `recover worker` started by hand, told to be
    replica 4 once step 1 is in (started as `--spare`, its imports and model build overlap the job's start:
    a cold start takes 3-15 s on 2 shared cores, longer than this whole job at a high load; what follows
    its order is a `--replica 4 --join` worker's path): it joins at a step boundary and takes its share (5
    members: quotas of 2, 2, 2, 1, 1 microbatches). The step time is not checked: with M = 8 the largest
    quota is 2 with 4 members as with 5, and 2 shared cores run every replica's compute in turn anyway.
    `recover status --coordinator --json` lists every member with its state while it runs; `recover drain 2`
    makes replica 2 leave at the next commit: it exits 0, is not restarted, and no failure is detected.
    Every step holds M microbatches, bitwise equal to the failure-free run, and the launcher exits 0."""
    run = tmp_path / "run"
    # 0.4 s of emulated device per microbatch (changes no number): after the fifth joins, the steps left must
    # outlast a `recover status` and a `recover drain` started as new interpreters on a loaded machine
    proc = _start_launch(run, corpus, "--max-replicas", "5", "--device-time-s", "0.4")
    fifth = None
    try:
        at = f"127.0.0.1:{_coordinator_start(run, proc)['port']}"
        with open(tmp_path / "fifth.log", "wb") as log:
            fifth = warmstart.popen([sys.executable, "-m", "recover", "worker", "--config", str(run / "config.json"),
                                      "--out", str(run), "--coordinator", at, "--token-file", str(run / "token"),
                                      "--procs", "4", "--spare"], env=subprocess_env(), start_new_session=True,
                                     stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
        _await_step(run, 1, proc)
        assert fifth.stdin is not None
        fifth.stdin.write(b'{"replica": 4, "fail": []}\n')
        fifth.stdin.close()
        _await_record(run, 4, proc)
        status = json.loads(run_recover(["status", "--coordinator", at, "--token-file", str(run / "token"),
                                         "--json"]).stdout)
        assert status["members"] == [0, 1, 2, 3, 4]
        assert {r["replica"]: r["state"] in ("computing", "waiting") for r in status["replicas"]} == dict.fromkeys(
            range(5), True)
        drained = run_recover(["drain", "2", "--coordinator", at, "--token-file", str(run / "token")]).stdout
        left_at = int(re.search(r"replica 2 drained at step (\d+)", drained).group(1))
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-3000:]
        assert fifth.wait(60) == 0, (tmp_path / "fifth.log").read_text()[-3000:]
    finally:
        _reap(run, proc)
    recs = every_step_bitwise(run, reference_det)
    five = [r for r in recs if r["live_replicas"] == 5]
    assert five and all(sorted(r["quotas"].values()) == [1, 1, 2, 2, 2] for r in five)  # the quota falls
    assert [r["live_replicas"] for r in recs if r["step"] > left_at] == [4] * (STEPS - 1 - left_at)
    ev = events(run)
    (gen,) = [e for e in ev if e["kind"] == "generation" and e["reason"] == "drain"]
    assert gen["members"] == [0, 1, 3, 4] and gen["dead"] == [2] and gen["step"] == left_at + 1
    assert [e["replicas"] for e in ev if e["kind"] == "drained"] == [[2]]
    assert not [e for e in ev if e["kind"] in ("failure_detected", "rejoin_started", "kill")]
    assert [e["code"] for e in ev if e["kind"] == "replica_exit" and e["replica"] == 2] == [0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["max_live_replicas"] == 5 and summary["drained"] == [2]
    assert summary["grown"] == [4] and summary["rejoins"] == 0
    assert "grew by replicas [4]; drained replicas [2]" in out.decode()
