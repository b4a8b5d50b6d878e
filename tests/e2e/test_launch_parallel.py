"""End to end: replicas of several ranks (pipeline, tensor parallel, FSDP2 shards) under `recover launch`.

Each configuration (pp2 with 1F1B, fsdp2, pp2 x tp2 with GPipe) runs 2 replicas of a 2-layer untied
`debug` model (M = 8) with the LAST rank of replica 1 SIGKILLed (pp2 x tp2) or SIGSTOPped for good
mid-step (its replica's other ranks are reaped, the surviving replica's ranks recover in-step on
their lanes); in the pp2 and fsdp2 cases the whole replica then rejoins from a hot
spare and takes its state, rank by rank, from the survivor; the fsdp2 case runs over TLS with mutual
authentication (the coordinator, the relays and every rank's connection). Checks: every step commits all M
microbatches; the per-step losses are within 2e-5 relative of a plain one-process run with the same
global batch (the failure-free layouts alone are compared with it in tests/dist/test_parallel_dist.py);
the BITWISE cases run in deterministic mode and their losses and grad norms equal, bit for bit, those of
a failure-free run of one replica of the same layout; and recovery took far less than the intra-replica
timeout (no rank of the surviving replica waited for a backend timeout).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import NO_PLOTS, losses, max_rel_diff, run_recover

STEPS = 12
M = 8
INTRA_TIMEOUT_S = 20.0
HANG_S = 2.0  # fault_tolerance.hang_timeout_s where a case hangs a training thread
MODEL = ["--model.n_layers=2", "--model.tie_embeddings=false", "--training.eval_every=0",
         f"--fault_tolerance.intra_replica_timeout_s={INTRA_TIMEOUT_S}", "--training.threads=1"]


def launch(out: Path, corpus: Path, *extra: str, replicas: int = 2) -> None:
    run_recover(["launch", NO_PLOTS,
                 "--config", "debug", "--replicas", str(replicas), "--steps", str(STEPS), "--out", str(out),
                 "--no-progress", "--data.path", str(corpus), *MODEL, *extra], timeout=300)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """One process, all M microbatches per step: plain data parallelism's arithmetic."""
    out = tmp_path_factory.mktemp("plain")
    run_recover(["train", "--config", "debug", "--out", str(out), "--no-progress", "--data.path", str(corpus),
                 f"--training.steps={STEPS}", *MODEL])
    return out


CONFIGS = {
    "pp2": ["--pp", "2"],
    "fsdp2": ["--fsdp", "2"],
    "pp2xtp2": ["--pp", "2", "--tp", "2", "--procs-per-replica", "4", "--parallel.schedule=gpipe"],
}
BITWISE = {"pp2", "fsdp2", "pp2xtp2"}
"""Cases that run in deterministic mode and must be bitwise equal to a failure-free run of their layout."""


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Callable[[str], Path]:
    """Layout -> a failure-free deterministic run of ONE replica of it (launched on first use): half the
    processes of a 2-replica run, and other splits of every step's ids than the runs compared with it."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(f"failure-free-{name}")
            launch(runs[name], corpus, *CONFIGS[name], "--deterministic", replicas=1)
            assert all(r["live_replicas"] == 1 for r in rows(runs[name]))
        return runs[name]

    return get


def check_trajectory(run: Path, plain: Path, reference: Path | None) -> None:
    """The per-step losses follow plain training; with a ``reference`` (same layout, deterministic, failure
    free) they and the grad norms are bitwise equal to its."""
    assert max_rel_diff(losses(plain), losses(run)) <= 2e-5
    if reference is not None:
        assert losses(run) == losses(reference)
        assert [r["grad_norm"] for r in rows(run)] == [r["grad_norm"] for r in rows(reference)]


FROZEN = {"pp2", "fsdp2"}
"""Cases whose rank is SIGSTOPped for good instead of SIGKILLed: fenced by its silence; its partners,
stuck in a collective inside the replica, leave within 2 s quietly; the launcher reaps the frozen one."""
REJOIN = {"pp2", "fsdp2"}


TLS = "fsdp2"
"""The case that runs over TLS with mutual authentication on the coordinator wire (``--tls-*``, the ``pki``
fixture's certificates; where there is no ``openssl`` to make them, it runs in the clear)."""


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kill_one_rank_of_a_replica(name: str, plain: Path, corpus: Path, tmp_path: Path,
                                    request: pytest.FixtureRequest) -> None:
    run = tmp_path / "killed"
    rejoin = ["--rejoin-after", "0.2"] if name in REJOIN else []
    fault = ["--freeze", "1@2:backward", "--device-time-s", "0.1"] if name in FROZEN else ["--fail", "1@2:backward"]
    tls = request.getfixturevalue("pki")["job"].flags() if name == TLS and shutil.which("openssl") else []
    deterministic = ["--deterministic"] if name in BITWISE else []
    launch(run, corpus, *CONFIGS[name], *fault, *rejoin, *tls, *deterministic)

    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert all(r["microbatches"] == M for r in recs)
    check_trajectory(run, plain, request.getfixturevalue("failure_free")(name) if name in BITWISE else None)
    live = {r["step"]: r["live_replicas"] for r in rows(run)}
    assert live[1] == 2 and live[2] == 1 and live[STEPS - 1] == (2 if rejoin else 1)

    ev = events(run)
    ranks = 4 if name == "pp2xtp2" else 2
    kills = [e for e in ev if e["kind"] == "kill"]
    assert [(k["replica"], k["rank"]) for k in kills] == [(1, ranks - 1)]
    exits = [(e["replica"], e["code"]) for e in ev if e["kind"] == "replica_exit"]
    assert (1, -9) in exits and (0, 0) in exits
    if name in FROZEN:  # the partner rank left on its own, quietly, soon after the fence
        fenced = next(e for e in ev if e["kind"] == "failure_detected" and e["replica"] == 1)
        first_exit = next(e for e in ev if e["kind"] == "replica_exit" and e["replica"] == 1)
        assert fenced["cause"] == "heartbeat_timeout" and first_exit["t"] - fenced["t"] < 2.0
        assert any(e["kind"] == "fenced_exit" and e["replica"] == 1 and e["rank"] == 0 for e in ev)
        partner_log = (run / "logs" / "replica_1_rank0.log").read_text()
        assert "fenced by the coordinator" in partner_log and "Traceback" not in partner_log
    if rejoin:  # every rank of the new replica 1 took its shard of the state, then trained to the end
        received = [e for e in ev if e["kind"] == "state_received" and e["replica"] == 1]
        assert sorted(e["rank"] for e in received) == list(range(ranks))
        assert exits.count((1, 0)) == 1
    recovered = [e for e in ev if e["kind"] == "recovered" and e["replica"] == 0]
    assert sorted(e["rank"] for e in recovered) == list(range(ranks))  # every rank of the survivor recovered
    assert next(e for e in ev if e["kind"] == "coordinator_start")["tls"] is bool(tls)
    assert not [e for e in ev if e["kind"] == "refused"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["min_microbatches"] == M and len(summary["recoveries"]) == 1
    assert summary["recoveries"][0]["latency_ms"] < INTRA_TIMEOUT_S * 1000 / 4
    failed = [r for r in rows(run) if r.get("failures")]
    assert [r["step"] for r in failed] == [2] and failed[0]["time_s"] < INTRA_TIMEOUT_S / 2


def test_a_killed_a_corrupted_and_a_hung_fsdp_replica_leave_the_run_bitwise_unaffected(
        plain: Path, corpus: Path, tmp_path: Path, failure_free: Callable[[str], Path]) -> None:
    """3 replicas of 2 FSDP ranks in deterministic mode, every fault on rank 1: replica 2 is SIGKILLed in
    step 1's backward and rejoins from a warm spare; one bit of replica 1's parameter shard flips before
    step 7 (the rejoin has time to land on busy cores): lane 0's fingerprint differs from the other two
    replicas', replica 1 is fenced before step 7 commits and its microbatches are recomputed by the others;
    replica 0's training thread hangs in step 9's backward (fenced as hung, the fence naming rank 1: rank 0,
    blocked in the replica's collective with it, reports that it waits). Every step holds M microbatches,
    bitwise equal to the failure-free run of one replica: the same ids in other pairs inside each replica's
    reduce-scatters change nothing."""
    run = tmp_path / "corrupt"
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "3", "--steps", str(STEPS), "--out", str(run),
                 "--no-progress", "--data.path", str(corpus), *MODEL, "--fsdp", "2", "--fail", "2@1:backward",
                 "--corrupt", "1@7", "--hang", "0@9:backward", "--fail-rank", "1", "--rejoin-after", "0.2",
                 f"--fault_tolerance.hang_timeout_s={HANG_S}", "--deterministic"], timeout=300)
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    check_trajectory(run, plain, failure_free("fsdp2"))
    ev = events(run)
    divergent = [e for e in ev if e["kind"] == "divergent"]
    assert [(d["step"], d["replicas"]) for d in divergent] == [(7, [1])]
    assert {r["step"]: r["live_replicas"] for r in recs}[1] == 2
    detected = [(e["replica"], e["cause"]) for e in ev if e["kind"] == "failure_detected"]
    assert [r for r, _ in detected[:3]] == [2, 1, 0] and detected[2][1] == "hung"
    assert [(e["replica"], e["step"]) for e in ev if e["kind"] == "kill"] == [(2, 1), (0, 9)]
    hung = [e["reason"] for e in ev if e["kind"] == "fenced" and e["replica"] == 0]
    assert len(hung) == 1 and hung[0].startswith("rank 1 made no progress"), hung


def test_a_killed_coordinator_a_corrupted_and_a_hung_pipeline_replica_leave_the_run_bitwise_unaffected(
        plain: Path, corpus: Path, tmp_path: Path, failure_free: Callable[[str], Path]) -> None:
    """3 replicas of 2 pipeline stages in deterministic mode, each reaching the coordinator through its relay;
    the coordinator SIGKILLs itself in step 4's commit after one reply went out: the relays keep their ranks,
    register again with what the replica holds, the replicas behind take the state of one ahead. Before step 8
    one bit of replica 2's parameters flips: its fingerprint differs, it is fenced before step 8 commits and
    its microbatches are recomputed by the others; replica 0's training thread hangs in step 10's backward and
    it is fenced as hung. Every step holds M microbatches, bitwise equal to the failure-free run of one
    replica: other splits of the same ids (3 replicas, then 2, then 1, under the weighted policy) change
    nothing."""
    run = tmp_path / "restart"
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "3", "--steps", str(STEPS), "--out", str(run),
                 "--no-progress", "--data.path", str(corpus), *MODEL, "--pp", "2", "--kill-coordinator", "4:1",
                 "--corrupt", "2@8", "--hang", "0@10:backward", f"--fault_tolerance.hang_timeout_s={HANG_S}",
                 "--deterministic"], timeout=300)
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    check_trajectory(run, plain, failure_free("pp2"))
    assert {r["step"]: r["live_replicas"] for r in recs}[7] == 3
    ev = events(run)
    rebuilt = [e for e in ev if e["kind"] == "rebuilt"]
    assert len(rebuilt) == 1 and rebuilt[0]["committed_step"] == 4 and rebuilt[0]["back"] == [0, 1, 2]
    assert 1 <= len(rebuilt[0]["behind"]) <= 2
    divergent = [e for e in ev if e["kind"] == "divergent"]
    assert [(d["step"], d["replicas"]) for d in divergent] == [(8, [2])]
    assert [e["replica"] for e in ev if e["kind"] == "fenced"] == [2, 0]  # the coordinator's restart fenced no one
    assert {r["step"]: r["live_replicas"] for r in recs}[8] == 2
    assert [(e["replica"], e["cause"]) for e in ev if e["kind"] == "failure_detected"][-1] == (0, "hung")
    assert [e["reason"].split(" made")[0] for e in ev if e["kind"] == "fenced" and e["replica"] == 0] == ["rank 1"]
    assert {r["step"]: r["live_replicas"] for r in recs}[STEPS - 1] == 1


def test_a_corrupted_and_a_hung_pipeline_x_tensor_parallel_replica_leave_the_run_bitwise_unaffected(
        plain: Path, corpus: Path, tmp_path: Path, failure_free: Callable[[str], Path]) -> None:
    """3 replicas of 2 pipeline stages x 2 tensor-parallel ranks in deterministic mode (the kill of one of their
    ranks is the parametrized case above): one bit of replica 1's parameters flips before step 4 (the other
    two outvote it: fenced, its microbatches recomputed by them); replica 0's training thread hangs in step 8's
    backward (fenced as hung; replica 2 finishes alone). Every step holds M microbatches, bitwise equal to the
    failure-free run of one replica."""
    run = tmp_path / "pp2xtp2"
    run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "3", "--steps", str(STEPS), "--out", str(run),
                 "--no-progress", "--data.path", str(corpus), *MODEL, *CONFIGS["pp2xtp2"], "--corrupt", "1@4",
                 "--hang", "0@8:backward", f"--fault_tolerance.hang_timeout_s={HANG_S}",
                 "--deterministic"], timeout=300)
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    check_trajectory(run, plain, failure_free("pp2xtp2"))
    ev = events(run)
    assert [(d["step"], d["replicas"]) for d in ev if d["kind"] == "divergent"] == [(4, [1])]
    detected = [(e["replica"], e["cause"]) for e in ev if e["kind"] == "failure_detected"]
    assert detected[-1] == (0, "hung") and len(detected) == 2
    assert [e["reason"].split(" made")[0] for e in ev if e["kind"] == "fenced" and e["replica"] == 0] == ["rank 3"]
    assert [r["live_replicas"] for r in recs if r["step"] in (3, 4, STEPS - 1)] == [3, 2, 1]


def test_a_nan_gradient_on_a_pipeline_stage_fences_its_replica_in_the_step(
        plain: Path, corpus: Path, tmp_path: Path, failure_free: Callable[[str], Path]) -> None:
    """2 replicas of 2 pipeline stages in deterministic mode; in step 5 the gradient of microbatch 6 becomes NaN
    on replica 1 (a faulty kernel): its loss stays finite, so only the stages' own gradient check sees it. The
    schedule mixed the column's microbatches, so the stage names all of them; replica 1 is fenced before the
    step commits and replica 0 recomputes its microbatches in the same step. Every step holds M microbatches,
    bitwise equal to the failure-free run of one replica."""
    run = tmp_path / "nan"
    launch(run, corpus, *CONFIGS["pp2"], "--nan", "1@5:6", "--workload.policy=even", "--deterministic")
    recs = rows(run)
    assert [r["step"] for r in recs] == list(range(STEPS)) and all(r["microbatches"] == M for r in recs)
    check_trajectory(run, plain, failure_free("pp2"))
    ev = events(run)
    reported = [(e["replica"], e["step"]) for e in ev if e["kind"] == "nonfinite" and "generation" in e]
    assert reported and set(reported) == {(1, 5)}
    assert all(6 in e["ids"] for e in ev if e["kind"] == "nonfinite" and "generation" in e)
    assert [e["replica"] for e in ev if e["kind"] == "fenced"] == [1]
    assert [r["live_replicas"] for r in recs if r["step"] in (4, 5)] == [2, 1]
