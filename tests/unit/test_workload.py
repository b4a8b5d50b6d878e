"""The workload policy: every id exactly once, quotas sum to M, deterministic, for every live set."""

from __future__ import annotations

import itertools
import random

import pytest

from recover.workload import (
    SpeedChange,
    SpeedTracker,
    assign,
    check_assignment,
    even_split,
    makespan,
    plan_step,
    quotas,
    replan,
    split_within_replica,
    static_assignment,
)

REPLICAS = range(8)
LIVE_SETS = [list(c) for k in range(1, 9) for c in itertools.combinations(REPLICAS, k)]  # all 255


def greedy_reference(n: int, reps: list[int], times: dict[int, float],
                     limits: dict[int, int]) -> dict[int, int]:
    """One microbatch at a time to the replica that would finish it first (ties: lower id)."""
    q = dict.fromkeys(reps, 0)
    for _ in range(n):
        open_ = [r for r in reps if q[r] < limits.get(r, n)]
        best = min(open_, key=lambda r: ((q[r] + 1) * times[r], r))
        q[best] += 1
    return q


def optimal_makespan(n: int, reps: list[int], times: dict[int, float], limits: dict[int, int]) -> float:
    best = float("inf")
    for qs in itertools.product(range(n + 1), repeat=len(reps)):
        if sum(qs) == n and all(q <= limits.get(r, n) for q, r in zip(qs, reps, strict=True)):
            best = min(best, max(q * times[r] for q, r in zip(qs, reps, strict=True)))
    return best


# ---- even split, exhaustively ---------------------------------------------------------------
def test_even_split_every_live_set_and_M() -> None:
    rng = random.Random(0)
    for live in LIVE_SETS:
        shuffled = live[:]
        rng.shuffle(shuffled)
        for M in range(1, 65):
            ids = list(range(M))
            a = assign(ids, live)
            check_assignment(a, ids)
            assert list(a) == live  # every live replica, sorted
            q = list(quotas(a).values())
            assert sum(q) == M and max(q) - min(q) <= 1
            assert q == sorted(q, reverse=True)  # the lower ids get the extra one
            assert [i for r in live for i in a[r]] == ids  # contiguous blocks in id order
            assert even_split(ids, shuffled) == a  # deterministic, the order of live is irrelevant


def test_blocks_follow_the_given_id_order() -> None:
    ids = [9, 3, 7, 1, 5]
    a = assign(ids, [4, 2])
    assert a == {2: [9, 3, 7], 4: [1, 5]}
    assert assign([], [1, 0]) == {0: [], 1: []}


# ---- throughput-weighted split -----------------------------------------------------------------
def random_times(rng: random.Random, live: list[int]) -> dict[int, float]:
    return {r: rng.choice([0.5, 1.0, 1.0, 1.3, 2.0, 3.7, rng.uniform(0.1, 5.0)]) for r in live}


def test_weighted_split_properties() -> None:
    rng = random.Random(1)
    for _ in range(1500):
        live = rng.choice(LIVE_SETS)
        M = rng.randint(1, 64)
        ids = list(range(M))
        times = random_times(rng, live)
        a = assign(ids, live, times=times)
        check_assignment(a, ids)
        q = quotas(a)
        assert sum(q.values()) == M
        assert q == greedy_reference(M, live, times, {})
        assert makespan(a, times) <= makespan(assign(ids, live), times) + 1e-12
        for x, y in itertools.permutations(live, 2):
            if times[x] > times[y]:
                assert q[x] <= q[y], (times, q)  # a slower replica never gets more
        assert assign(ids, list(reversed(live)), times=dict(reversed(list(times.items())))) == a


def test_weighted_split_is_makespan_optimal_small() -> None:
    rng = random.Random(2)
    for _ in range(150):
        live = sorted(rng.sample(range(8), rng.randint(1, 3)))
        M = rng.randint(1, 8)
        times = random_times(rng, live)
        limits = {r: rng.randint(0, M) for r in live if rng.random() < 0.5}
        if sum(limits.get(r, M) for r in live) < M:
            continue
        a = assign(range(M), live, times=times, limits=limits)
        assert makespan(a, times) == pytest.approx(optimal_makespan(M, live, times, limits))


def test_equal_times_give_the_even_split_and_a_slow_replica_gets_less() -> None:
    assert assign(range(10), [0, 1, 2], times={0: 2.0, 1: 2.0, 2: 2.0}) == assign(range(10), [0, 1, 2])
    a = assign(range(12), [0, 1, 2], times={0: 1.0, 1: 1.0, 2: 2.0})
    assert quotas(a) == {0: 5, 1: 5, 2: 2}
    assert makespan(a, {0: 1.0, 1: 1.0, 2: 2.0}) == 5.0


def test_missing_times_take_the_median() -> None:
    assert assign(range(9), [0, 1, 2], times={0: 1.0, 1: 2.0}) == assign(range(9), [0, 1, 2],
                                                                         times={0: 1.0, 1: 2.0, 2: 1.5})
    assert assign(range(9), [0, 1, 2], times={7: 3.0}) == assign(range(9), [0, 1, 2])  # none of the live


# ---- limits ---------------------------------------------------------------------------------------
def test_limits_are_respected_and_the_excess_goes_elsewhere() -> None:
    rng = random.Random(3)
    for _ in range(1500):
        live = rng.choice(LIVE_SETS)
        M = rng.randint(1, 64)
        limits = {r: rng.randint(0, M) for r in live if rng.random() < 0.6}
        times = random_times(rng, live) if rng.random() < 0.5 else None
        room = sum(limits.get(r, M) for r in live)
        if room < M:
            with pytest.raises(ValueError, match=f"short by {M - room}"):
                assign(range(M), live, times=times, limits=limits)
            continue
        a = assign(range(M), live, times=times, limits=limits)
        check_assignment(a, range(M))
        q = quotas(a)
        assert all(q[r] <= c for r, c in limits.items())
        assert q == greedy_reference(M, live, times or dict.fromkeys(live, 1.0), limits)
        if times is None:  # the unlimited replicas stay even among themselves
            free = [q[r] for r in live if r not in limits or q[r] < limits[r]]
            assert not free or max(free) - min(free) <= 1


def test_limits_example_and_message() -> None:
    assert assign(range(10), [0, 1, 2], limits={0: 1}) == {0: [0], 1: [1, 2, 3, 4, 5], 2: [6, 7, 8, 9]}
    with pytest.raises(ValueError, match=r"hold at most 5 of 10 microbatches \(short by 5\)"):
        assign(range(10), [0, 1], limits={0: 2, 1: 3})


@pytest.mark.parametrize("kwargs, match", [
    ({"ids": [1, 2], "live": []}, "no live replicas"),
    ({"ids": [1, 2, 1], "live": [0]}, r"ids \[1\] appear more than once"),
    ({"ids": [1], "live": [0, 0]}, "repeat a replica"),
    ({"ids": [1], "live": [0], "times": {0: 0.0}}, r"times\[0\]"),
    ({"ids": [1], "live": [0], "times": {0: float("nan")}}, r"times\[0\]"),
    ({"ids": [1], "live": [0], "limits": {0: -1}}, r"limits\[0\]"),
])
def test_bad_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        assign(**kwargs)


# ---- replan -------------------------------------------------------------------------------------
def test_replan_covers_exactly_the_orphans() -> None:
    rng = random.Random(4)
    for _ in range(2000):
        live = rng.choice([s for s in LIVE_SETS if len(s) >= 2])
        M = rng.randint(1, 64)
        ids = list(range(M))
        a = assign(ids, live)
        dead = set(rng.sample(live, rng.randint(1, len(live) - 1)))
        survivors = [r for r in live if r not in dead]
        # survivors' ledgers: some of their own ids, and some ids a dead replica had (an earlier round)
        ledger = {r: {i for i in a[r] if rng.random() < 0.7} for r in live}
        handed = {i for r in dead for i in a[r] if rng.random() < 0.2}
        for i in handed:
            ledger[rng.choice(survivors)].add(i)
        times = random_times(rng, live) if rng.random() < 0.5 else None
        new = replan(a, ledger, dead, live, times=times)
        orphans = {i for r in dead for i in a[r]} - handed
        assert list(new) == survivors  # only survivors get work
        check_assignment(new, orphans)
        # own ids + orphans already held by survivors + new work = every id once
        whole = {**{r: a[r] for r in survivors}, -1: sorted(handed), **{-2 - r: v for r, v in new.items()}}
        check_assignment(whole, ids)
        assert replan(a, ledger, dead, list(reversed(live)), times=times) == new


def test_replan_examples() -> None:
    a = {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7]}
    assert replan(a, None, {0}, [0, 1, 2]) == {1: [0, 1], 2: [2]}
    assert replan(a, {1: {3, 4, 5, 0}}, {0}, [1, 2]) == {1: [1], 2: [2]}
    assert replan(a, {0: {0, 1, 2}}, {0}, [0, 1, 2]) == {1: [0, 1], 2: [2]}  # dead ledgers don't count
    assert replan(a, None, set(), [0, 1, 2]) == {0: [], 1: [], 2: []}
    assert replan(a, None, {0, 1}, [0, 1, 2]) == {2: [0, 1, 2, 3, 4, 5]}  # all but one lost
    # a second failure during recovery: pass the merged assignment
    merged = {1: [3, 4, 5, 0, 1], 2: [6, 7, 2]}
    assert replan(merged, {2: {6, 7, 2}}, {1}, [1, 2]) == {2: [0, 1, 3, 4, 5]}


def test_replan_limits_are_per_step_totals() -> None:
    a = {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7]}
    assert replan(a, None, {0}, [1, 2], limits={1: 3, 2: 5}) == {1: [], 2: [0, 1, 2]}
    with pytest.raises(ValueError, match="short by 1"):
        replan(a, None, {0}, [1, 2], limits={1: 3, 2: 4})


def test_replan_refusals() -> None:
    a = {0: [0, 1], 1: [2, 3]}
    with pytest.raises(ValueError, match="no survivor"):
        replan(a, None, {0, 1}, [0, 1])
    assert replan({0: [], 1: []}, None, {0, 1}, [0, 1]) == {}
    with pytest.raises(ValueError, match=r"replicas \[1\] of the assignment are neither live nor dead"):
        replan(a, None, {0}, [2])


# ---- inside a replica ---------------------------------------------------------------------------
def test_split_within_replica_pads_with_none() -> None:
    for n in range(0, 33):
        ids = [100 + i for i in range(n)]
        for ranks in range(1, 9):
            parts = split_within_replica(ids, ranks)
            passes = -(-n // ranks)
            assert len(parts) == ranks and all(len(p) == passes for p in parts)
            real = [[i for i in p if i is not None] for p in parts]
            assert [i for p in real for i in p] == ids
            assert max(map(len, real)) - min(map(len, real)) <= 1
            assert all(None not in p[:len(r)] for p, r in zip(parts, real, strict=True))  # padding at the end
    assert split_within_replica([1, 2, 3, 4, 5], 4) == [[1, 2], [3, None], [4, None], [5, None]]
    with pytest.raises(ValueError, match="ranks"):
        split_within_replica([1], 0)


# ---- checks and the failure-free plans -------------------------------------------------------
def test_check_assignment_messages() -> None:
    check_assignment({0: [0, 1], 1: [2]}, range(3))
    with pytest.raises(ValueError, match=r"missing ids \[2\]"):
        check_assignment({0: [0, 1]}, range(3))
    with pytest.raises(ValueError, match=r"more than once \[1\]"):
        check_assignment({0: [0, 1], 1: [1, 2]}, range(3))
    with pytest.raises(ValueError, match=r"unknown ids \[7\]"):
        check_assignment({0: [0, 1, 2, 7]}, range(3))


def test_static_assignment_unchanged() -> None:
    assert static_assignment(10, 3, step=0) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert static_assignment(10, 3, step=0, how="strided") == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    for step in range(5):
        s = static_assignment(16, 4, step, how="shuffled", seed=3)
        assert sorted(i for p in s for i in p) == list(range(16)) and [len(p) for p in s] == [4] * 4
        assert s == static_assignment(16, 4, step, how="shuffled", seed=3)
    assert static_assignment(16, 4, 0, "shuffled", 3) != static_assignment(16, 4, 1, "shuffled", 3)
    with pytest.raises(ValueError, match="not one of"):
        static_assignment(4, 2, 0, how="random")


# ---- plans with speeds ----------------------------------------------------------------------------
def test_plan_step_weights_quotas_and_keeps_the_id_order_of_each_assignment() -> None:
    times = {0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0}
    for how in ("blocks", "strided", "shuffled"):
        plan = plan_step(16, [3, 1, 0, 2], step=5, how=how, seed=7, times=times)
        check_assignment(plan, range(16))
        assert quotas(plan) == {0: 5, 1: 5, 2: 5, 3: 1}, how  # makespan 5, the optimum
    assert plan_step(16, range(4), 0, "strided", times=times)[3] == [3]
    assert plan_step(10, range(3), 0, "strided") == {0: [0, 3, 6, 9], 1: [1, 4, 7], 2: [2, 5, 8]}


def _observe(tracker: SpeedTracker, times: dict[int, float], steps: int, noise: float = 0.0,
             seed: int = 0) -> list[SpeedChange]:
    rng = random.Random(seed)
    changes = []
    for _ in range(steps):
        samples = {r: t * (1 + rng.uniform(-noise, noise)) for r, t in times.items()}
        changes += tracker.observe(32, times, samples)
    return changes


def test_noise_never_moves_microbatches() -> None:
    tracker = SpeedTracker()
    changes = _observe(tracker, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}, steps=500, noise=0.2)
    assert changes == [] and tracker.planned is None


def test_a_straggler_is_rebalanced_once_named_and_cleared_when_it_recovers() -> None:
    tracker = SpeedTracker()
    changes = _observe(tracker, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}, steps=20, noise=0.05)
    assert [c.kind for c in changes] == ["rebalanced", "straggler"] and changes[1].replica == 3
    assert changes[0].factor > 1.5  # the even split's step over the weighted one's
    assert quotas(assign(range(32), range(4), tracker.planned)) in ({0: 9, 1: 9, 2: 9, 3: 5}, {0: 9, 1: 9, 2: 8, 3: 6})
    changes = _observe(tracker, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}, steps=20, noise=0.05)
    assert [c.kind for c in changes] == ["rebalanced", "straggler_cleared"]


def test_every_speed_change_is_an_event_the_coordinator_can_write() -> None:
    from recover.names import Event

    tracker = SpeedTracker()
    kinds = {c.kind for slow in (0.2, 0.1) for c in _observe(tracker, {0: 0.1, 1: 0.1, 2: 0.1, 3: slow}, steps=20,
                                                             noise=0.05)}
    assert kinds == {"rebalanced", "straggler", "straggler_cleared"}
    assert {Event(k) for k in kinds} == {Event.REBALANCED, Event.STRAGGLER, Event.STRAGGLER_CLEARED}


def test_a_replica_left_without_work_is_probed_with_one_microbatch() -> None:
    tracker = SpeedTracker(stale_steps=5)
    _observe(tracker, {0: 0.1, 1: 0.1, 2: 10.0}, steps=3)
    assert quotas(assign(range(32), range(3), tracker.planned))[2] == 0
    for _ in range(5):  # replica 2 computes nothing, so it reports no sample
        tracker.observe(32, range(3), {0: 0.1, 1: 0.1})
    assert quotas(assign(range(32), range(3), tracker.planned))[2] == 1
    tracker.forget(2)
    assert 2 not in (tracker.planned or {}) and 2 not in tracker.stragglers


def test_a_probe_that_finds_the_replica_recovered_gives_it_its_share_back() -> None:
    tracker = SpeedTracker(stale_steps=5)
    _observe(tracker, {0: 0.1, 1: 0.1, 2: 10.0}, steps=3)
    for _ in range(5):
        tracker.observe(32, range(3), {0: 0.1, 1: 0.1})
    assert quotas(assign(range(32), range(3), tracker.planned))[2] == 1  # the probe
    tracker.observe(32, range(3), {0: 0.1, 1: 0.1, 2: 10.0})  # still slow: no work again
    assert quotas(assign(range(32), range(3), tracker.planned))[2] == 0
    for _ in range(5):
        tracker.observe(32, range(3), {0: 0.1, 1: 0.1})
    changes = tracker.observe(32, range(3), {0: 0.1, 1: 0.1, 2: 0.1})  # recovered
    assert [c.kind for c in changes] == ["rebalanced", "straggler_cleared"]
    assert quotas(assign(range(32), range(3), tracker.planned)) == {0: 11, 1: 11, 2: 10}


def test_slowdowns_match_the_plain_definition() -> None:
    import statistics

    from recover.workload import slowdowns

    rng = random.Random(5)
    for n in (1, 2, 3, 4, 7, 10):
        times = {r: rng.choice([0.1, 0.2, rng.uniform(0.05, 1.0)]) for r in range(n)}
        plain = {r: t / statistics.median([v for k, v in times.items() if k != r]) if n > 1 else 1.0
                 for r, t in times.items()}
        assert slowdowns(times) == pytest.approx(plain)
