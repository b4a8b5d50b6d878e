"""The hang rule of the coordinator (:mod:`recover.coord.liveness`), pure: time is passed in."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from recover.coord.liveness import Liveness


def started(n: int, ranks: int = 1, **kwargs: float) -> Liveness:
    live = Liveness(**kwargs)
    for r in range(n):
        live.start(r, ranks, now=0.0)
    return live


def test_a_replica_without_progress_while_others_wait_is_hung_after_the_timeout() -> None:
    live = started(3, hang_timeout_s=3.0)
    for t in (0.5, 1.0):  # everyone computes and advances
        for r in range(3):
            live.heartbeat(r, 0, progress=int(t * 10), activity="compute", now=t)
    for t in (1.5, 2.0, 3.5, 4.0):  # replica 1 stops advancing; 0 and 2 wait for it in a collective
        live.heartbeat(0, 0, 20, "wait", t)
        live.heartbeat(2, 0, 20, "wait", t)
        live.heartbeat(1, 0, 10, "compute", t)
    assert live.hung(3.9) == []  # 2.9 s without progress
    hung = live.hung(4.1)
    assert [r for r, _ in hung] == [1] and "made no progress for 3.1 s" in hung[0][1]
    assert "while replicas [0, 2] waited for it" in hung[0][1]


def test_waiting_io_and_a_first_step_slow_everywhere_are_never_hung() -> None:
    live = started(2, hang_timeout_s=1.0)
    live.heartbeat(0, 0, 5, "io", 0.1)  # a long checkpoint save while the other waits
    live.heartbeat(1, 0, 5, "wait", 0.1)
    assert live.hung(10.0) == []
    live.heartbeat(0, 0, 5, "compute", 11.0)  # everyone computes without progress: slow, not hung
    live.heartbeat(1, 0, 5, "compute", 11.0)
    assert live.hung(20.0) == []
    alone = started(1, hang_timeout_s=1.0)
    alone.heartbeat(0, 0, 1, "compute", 0.1)
    assert alone.hung(20.0) == []  # compiling its first step: nobody waits and it never voted


def test_a_lone_replica_past_its_first_step_is_hung_without_anyone_waiting() -> None:
    """The lone survivor (or every replica at once) stops advancing after a vote: hung after the timeout,
    though no peer waits; a replica registered again starts unjudged until its own first vote."""
    live = started(2, hang_timeout_s=2.0)
    for r in range(2):
        live.heartbeat(r, 0, 5, "compute", 0.5)
        live.voted(r, 0, 0.6)
    live.committed(0, 0.7)
    live.forget(1)  # replica 1 is gone: 0 trains alone
    live.heartbeat(0, 0, 9, "compute", 1.0)
    assert live.hung(2.9) == []
    hung = live.hung(3.1)
    assert [r for r, _ in hung] == [0] and "with no other replica waiting" in hung[0][1]
    live.start(1, 1, now=3.2)  # a new replica 1, in its first step: not judged by this rule
    live.heartbeat(1, 0, 1, "compute", 3.3)
    assert [r for r, _ in live.hung(10.0)] == [0]


def test_the_clock_restarts_on_progress_and_on_entering_compute() -> None:
    live = started(2, hang_timeout_s=2.0)
    live.heartbeat(1, 0, 1, "wait", 0.0)
    live.heartbeat(0, 0, 1, "wait", 0.0)
    live.heartbeat(0, 0, 1, "compute", 5.0)  # waited long, then computes: judged from now on
    assert live.hung(6.0) == []
    live.heartbeat(0, 0, 2, "compute", 6.5)
    assert live.hung(8.0) == [] and [r for r, _ in live.hung(8.6)] == [0]


def test_any_rank_of_a_replica_can_hang_it_and_forget_drops_it() -> None:
    live = started(2, ranks=2, hang_timeout_s=1.0)
    for rank in (0, 1):
        live.heartbeat(0, rank, 3, "wait", 0.5)
    live.heartbeat(1, 0, 3, "wait", 0.5)  # rank 0 reached the collective,
    live.heartbeat(1, 1, 3, "compute", 0.5)  # rank 1 is stuck
    assert [(r, "rank 1" in why) for r, why in live.hung(2.0)] == [(1, True)]
    live.forget(1)
    assert live.hung(5.0) == []
    live.heartbeat(1, 1, 9, "compute", 5.0)  # a heartbeat of a forgotten replica is ignored
    assert live.hung(9.0) == []


def test_the_automatic_timeout_follows_the_median_step_time() -> None:
    live = Liveness(min_s=60.0, factor=10.0)
    assert live.timeout() == 60.0
    for step in range(5):
        live.committed(step, now=step * 12.0)
        live.committed(step, now=step * 12.0 + 0.1)  # each rank's commit of the same step: counted once
    assert live.timeout() == pytest.approx(120.0)  # 10 x the 12 s median step
    assert Liveness(hang_timeout_s=5.0).timeout() == 5.0
    with pytest.raises(ValueError):
        Liveness(hang_timeout_s=-1.0)


def test_a_training_thread_stuck_in_a_wait_of_an_older_generation_is_hung() -> None:
    """Everyone waits: replica 2's thread froze inside a wait of generation 1 (its process acks and
    heartbeats on). Generation 2 forms; the others move on to it at once, replica 2 never does."""
    live = started(3, hang_timeout_s=2.0)
    for r in range(3):
        live.heartbeat(r, 0, 10, "wait", 1.0, generation=1)
    live.formed(2, [0, 1, 2], now=1.0)
    for t in (1.1, 2.0, 3.0):
        live.heartbeat(0, 0, 11, "wait", t, generation=2)
        live.heartbeat(1, 0, 11, "wait", t, generation=2)
        live.heartbeat(2, 0, 10, "wait", t, generation=1)
    assert live.hung(2.9) == []  # within the timeout of the formation
    hung = live.hung(3.1)
    assert [r for r, _ in hung] == [2] and "still waiting in generation 1" in hung[0][1]
    old = started(2, hang_timeout_s=2.0)  # older clients report no generation: not judged this way
    old.formed(3, [0, 1], now=0.0)
    for r in range(2):
        old.heartbeat(r, 0, 1, "wait", 5.0)
    assert old.hung(5.0) == []


def test_a_training_thread_stuck_in_a_save_or_evaluation_is_hung_after_the_longer_io_timeout() -> None:
    live = started(2, hang_timeout_s=1.0)
    live.heartbeat(0, 0, 5, "io", 0.0)
    live.heartbeat(1, 0, 5, "wait", 0.0)
    assert live.hung(9.9) == []
    hung = live.hung(10.1)
    assert [r for r, _ in hung] == [0] and "in a save or evaluation" in hung[0][1] and live.away(0)


def test_a_member_that_never_votes_after_the_others_did_is_hung() -> None:
    """Everyone is in a wait and no generation changes: replicas 0 and 1 voted (the reduction
    completed), replica 2's thread stopped right after it and never votes."""
    live = started(3, hang_timeout_s=2.0)
    live.formed(1, [0, 1, 2], now=0.0)
    for r in range(3):
        live.heartbeat(r, 0, 7, "wait", 0.5, generation=1)
    live.voted(0, 0, 0.6)
    live.voted(1, 0, 0.7)
    assert live.hung(2.5) == []
    hung = live.hung(2.7)
    assert [r for r, _ in hung] == [2] and "has not voted" in hung[0][1]
    live.committed(0, 2.8)  # a commit (or a new generation) ends the ballot
    assert live.hung(10.0) == []


def test_the_rank_named_is_the_stuck_one_not_its_partner_blocked_in_a_collective() -> None:
    """Replica 0 of two ranks: rank 1's training thread is stuck; rank 0 waits for it inside the replica (its
    heartbeats say ``wait``, :func:`recover.coord.client.in_collective`), or, where it cannot tell, is
    ahead of it: the fence names rank 1 either way."""
    for partner in ("wait", "compute"):
        live = started(2, ranks=2, hang_timeout_s=2.0)
        for t in (0.5, 1.0, 2.0, 3.5):
            live.heartbeat(0, 0, 21 if partner == "compute" else 20, partner, t)
            live.heartbeat(0, 1, 20, "compute", t)
            live.heartbeat(1, 0, 20, "wait", t)
            live.heartbeat(1, 1, 20, "wait", t)
        (hung,) = live.hung(3.6)
        assert hung[0] == 0 and hung[1].startswith("rank 1 made no progress"), (partner, hung)


def test_a_thread_blocked_in_torch_distributed_counts_as_waiting(tmp_path: Path) -> None:
    """A rendezvous of two ranks that only one joins blocks its thread inside ``torch.distributed``."""
    import datetime
    import threading

    import torch.distributed as dist

    from recover.coord.client import in_collective

    me = threading.get_ident()
    assert not in_collective(me)
    done = threading.Event()

    def rendezvous() -> None:
        try:
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=2,
                                    timeout=datetime.timedelta(seconds=3))
        except Exception:  # the second rank never comes: it times out, which is the point
            pass
        finally:
            done.set()

    thread = threading.Thread(target=rendezvous, daemon=True)
    thread.start()
    deadline = time.monotonic() + 2.5
    while not in_collective(me) and time.monotonic() < deadline and not done.is_set():
        time.sleep(0.05)
    assert in_collective(me)
    done.wait(10)
    assert not in_collective(me)


def _hung_by_every_rank(live: Liveness, now: float) -> list[tuple[int, str]]:
    """The hang rule as it read before per-replica summaries: every rank of every replica visited each scan."""
    from recover.coord.liveness import IO_FACTOR

    waiting = {rep for rep, ranks in live._replicas.items() if any(r.activity == "wait" for r in ranks.values())}
    limit = live.timeout()
    out = []
    for replica, ranks in sorted(live._replicas.items()):
        others = sorted(waiting - {replica})
        stale = [(k, now - r.since) for k, r in ranks.items()
                 if (r.activity == "compute" and now - r.since > limit)
                 or (r.activity == "io" and now - r.since > IO_FACTOR * limit)]
        behind = live._behind(replica, ranks, now, limit)
        if stale and (others or replica in live._warm):
            rank, silent = min(stale, key=lambda ks: (ranks[ks[0]].progress, -ks[1], ks[0]))
            io = ranks[rank].activity == "io"
            where, allowed = ("in a save or evaluation, ", IO_FACTOR * limit) if io else ("", limit)
            why = f"while replicas {others} waited for it" if others else "with no other replica waiting"
            out.append((replica, f"rank {rank} made no progress for {silent:.1f} s ({where}hang timeout "
                                 f"{allowed:.1f} s) {why}"))
        elif behind is not None:
            out.append((replica, behind))
        elif (stuck := live._not_voting(replica, ranks, now, limit)) is not None:
            out.append((replica, stuck))
    return out


def test_the_scan_by_replica_summaries_judges_exactly_as_a_visit_of_every_rank() -> None:
    import random

    rng = random.Random(7)
    verdicts = 0
    for trial in range(40):
        live = started(rng.randint(2, 6), ranks=rng.randint(1, 4), hang_timeout_s=rng.choice([0.0, 1.0, 2.5]))
        now, generation = 0.0, 1
        for _ in range(300):
            now += rng.uniform(0.0, 0.4)
            what = rng.random()
            replicas = sorted(live._replicas)
            if what < 0.6 and replicas:
                r = rng.choice(replicas)
                live.heartbeat(r, rng.randrange(len(live._replicas[r])), rng.randint(0, 8),
                               rng.choice(["compute", "wait", "io", "bogus", None]), now,
                               rng.choice([None, generation - 1, generation]))
            elif what < 0.68:
                generation += 1
                live.formed(generation, [r for r in replicas if rng.random() < 0.8], now)
            elif what < 0.76 and replicas:
                live.voted(rng.choice(replicas), rng.choice([None, 0]), now)
            elif what < 0.82:
                live.committed(rng.randint(0, 50), now)
            elif what < 0.85:
                live.pause(rng.uniform(0.0, 1.0))
            elif what < 0.88 and len(replicas) > 1:
                live.forget(rng.choice(replicas))
            elif what < 0.91:
                live.start(max(replicas, default=-1) + 1, rng.randint(1, 4), now)
            expected = _hung_by_every_rank(live, now)
            assert live.hung(now) == expected, (trial, now)
            verdicts += bool(expected)
    assert verdicts > 100, "the random runs must reach hangs for the comparison to mean anything"


def test_a_batched_heartbeat_of_every_rank_is_a_heartbeat_of_each_rank() -> None:
    """:meth:`Liveness.beats` (a relay's ``hbs``, a list at a time) leaves every rank, and so every verdict,
    exactly as one :meth:`Liveness.heartbeat` per rank in rank order would."""
    import random

    rng = random.Random(11)
    for trial in range(60):
        replicas, ranks = rng.randint(1, 4), rng.randint(1, 6)
        kwargs = {"hang_timeout_s": rng.choice([1.0, 2.5])}
        batched, each = started(replicas, ranks, **kwargs), started(replicas, ranks, **kwargs)
        now = 0.0
        for _ in range(200):
            now += rng.uniform(0.0, 0.6)
            r = rng.randrange(replicas)
            if rng.random() < 0.2:  # a lone rank's own heartbeat (a connection per rank), on both
                k = rng.randrange(ranks)
                args = (rng.randint(0, 4), rng.choice(["compute", "wait", "io", "bogus", None]), now,
                        rng.choice([None, 1, 2]))
                batched.heartbeat(r, k, *args)
                each.heartbeat(r, k, *args)
                continue
            same = rng.random() < 0.5  # often every rank alike, as a replica's ranks mostly are
            progress = [rng.randint(0, 4)] * ranks if same else [rng.randint(0, 4) for _ in range(ranks)]
            acts = rng.choice([["compute"] * ranks, [rng.choice(["compute", "wait", "io"]) for _ in range(ranks)]])
            gens = [rng.choice([1, 2]) for _ in range(ranks)]
            batched.beats(r, progress, acts, now, gens)
            for k in range(ranks):
                each.heartbeat(r, k, progress[k], acts[k], now, gens[k])
            if rng.random() < 0.1:
                for live in (batched, each):
                    live.voted(r, None, now)
            if rng.random() < 0.05:
                for live in (batched, each):
                    live.formed(int(now) + 2, list(range(replicas)), now)
            if rng.random() < 0.05:
                for live in (batched, each):
                    live.pause(0.5)
            assert {r: dict(v) for r, v in batched._replicas.items()} == \
                {r: dict(v) for r, v in each._replicas.items()}, (trial, now)
            assert batched.hung(now) == each.hung(now), (trial, now)
    with pytest.raises(ValueError, match="names 2 ranks"):
        started(1, 3).beats(0, [1, 1], ["compute"] * 2, 1.0, [1, 1])
