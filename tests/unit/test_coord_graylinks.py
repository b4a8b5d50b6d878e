"""The slow-link rule (recover.coord.graylinks): pure, deterministic; and its path through the coordinator's
rank logic (probes asked of every member, the verdict, the fence with cause ``slow_link``, the joiner held back
until its probe shows its link recovered)."""

from __future__ import annotations

from typing import Any

import pytest
from test_coord_ranks_logic import TOKEN, logs, msg, sent

from recover.coord.graylinks import (
    GATHER_S,
    PROBE_BYTES,
    SlowLinks,
    Split,
    judge,
    link_times,
    median_split,
    readmit,
)
from recover.coord.protocol import Ballot
from recover.coord.ranks import RankAggregator
from recover.coord.state import MembershipState

FAST, SLOW = 0.002, 0.40  # seconds of one probe round trip on a healthy link and an 8 Mbit/s one

M = 8


def split(members: list[int], comp: float = 0.03, comm: float = 1.8, mb: float = 0.015,
          waits: dict[int, float] | None = None) -> Split:
    """A commit of ``members``, each computing ``comp`` s at ``mb`` s per microbatch; the last to finish
    computing waits ``comm`` s in the reduction, the others a little longer."""
    w = {r: comm + 0.001 * i for i, r in enumerate(members)} if waits is None else waits
    return Split(M, {r: mb for r in members}, {r: comp for r in members}, w)


def probes(members: list[int], slow: set[int]) -> dict[int, dict[int, float]]:
    """What each member's probe measures: a pair is slow when either end's link is."""
    return {a: {b: SLOW if {a, b} & slow else FAST for b in members if b != a} for a in members}


# ----------------------------------------------------------------- the pure rule


def test_a_replica_whose_own_link_is_slow_has_no_fast_pair() -> None:
    links = link_times([0, 1, 2, 3], probes([0, 1, 2, 3], {3}))
    assert links == {0: FAST, 1: FAST, 2: FAST, 3: SLOW}
    # a pair's time is the lower of its two measurements (one may have queued behind the reduction)
    assert link_times([0, 1], {0: {1: 0.5}, 1: {0: 0.1}}) == {0: 0.1, 1: 0.1}
    assert link_times([0, 1, 2], {0: {1: 0.1}}) == {0: 0.1, 1: 0.1}  # 2 measured no pair: left out


def test_one_slow_link_is_fenced_with_the_step_estimated_without_it() -> None:
    members = [0, 1, 2, 3]
    s = split(members)
    v = judge(members, s, link_times(members, probes(members, {2})))
    assert (v.replica, v.fenced) == (2, True)
    assert v.step_s == pytest.approx(0.03 + 1.8)
    # without 2: 8 microbatches over three at 0.015 s each, and the reduction at the fast links' pace
    assert v.without_s == pytest.approx(8 / (3 / 0.015) + 1.8 * FAST / SLOW)
    assert v.ratio > 1.5


def test_links_equally_slow_fence_nobody_nor_does_a_pair_or_the_quorum() -> None:
    members = [0, 1, 2, 3]
    everyone = judge(members, split(members), link_times(members, probes(members, {0, 1, 2, 3})))
    assert not everyone.fenced and everyone.ratio < 1.0  # nobody is better without any one of them
    pair = judge([0, 1], split([0, 1]), link_times([0, 1], probes([0, 1], {1})))
    assert not pair.fenced  # one pair cannot tell whose link it is
    quorum = judge(members, split(members), link_times(members, probes(members, {3})), min_members=4)
    assert quorum.replica == 3 and not quorum.fenced


def test_a_reduction_that_is_not_the_bottleneck_fences_nobody() -> None:
    members = [0, 1, 2, 3]
    # the reduction takes 10 ms of a 100 ms step: even a slow-probing link would not be worth fencing
    s = split(members, comp=0.1, comm=0.01, mb=0.05)
    assert not s.comm_bound(1.5)
    assert not judge(members, s, link_times(members, probes(members, {1}))).fenced


def test_the_verdict_is_deterministic_ties_go_to_the_higher_id() -> None:
    members = [0, 1, 2, 3]
    links = link_times(members, probes(members, {1, 3}))  # two slow links: each pair with a slow end is slow
    assert links[1] == links[3] == SLOW
    assert judge(members, split(members), links).replica == 3
    assert judge(members, split(members), links) == judge(members, split(members), links)


def test_readmission_once_the_probe_shows_the_step_with_it_within_the_factor() -> None:
    now = split([0, 1, 2], comp=0.04, comm=0.005)  # three members, healthy
    ok, with_it = readmit(SLOW, SLOW, 1.8, 0.015, now)
    assert not ok and with_it > 1.5 * now.step  # still 8 Mbit/s
    ok, with_it = readmit(FAST, SLOW, 1.8, 0.015, now)
    assert ok and with_it <= 1.5 * now.step


def test_the_medians_of_several_commits() -> None:
    a, b, c = split([0, 1], comm=1.0), split([0, 1], comm=5.0), split([0, 1], comm=2.0)
    assert median_split([a, b, c]).reduction == pytest.approx(2.0)


# ----------------------------------------------------------------- its state across commits


def test_k_communication_bound_commits_then_a_probe_then_the_fence_then_the_joiner_held() -> None:
    slow = SlowLinks(factor=1.5, steps=3)
    members = (0, 1, 2, 3)
    assert not slow.observe(1, 0, members, split(list(members)))
    assert not slow.observe(1, 1, members, split(list(members), comp=0.1, comm=0.01))  # not bound: counts anew
    assert [slow.observe(1, s, members, split(list(members))) for s in (2, 3, 4)] == [False, False, True]
    slow.started(10.0)
    assert not slow.observe(1, 5, members, split(list(members)))  # one probe at a time
    for r, times in probes(list(members), {3}).items():
        assert slow.settle(10.1, members, 1) is None if r == 0 else True
        slow.answered(r, times)
    v = slow.settle(10.2, members, 1)
    assert v is not None and (v.replica, v.named, v.fenced) == (3, True, False)  # named once: probed again
    assert slow.observe(1, 6, members, split(list(members)))  # at the next communication-bound commit
    slow.started(12.0)
    for r, times in probes(list(members), {3}).items():
        slow.answered(r, times)
    v = slow.settle(12.2, members, 1)
    assert v is not None and (v.replica, v.named, v.fenced) == (3, True, True) and slow.held(3)
    slow.observe(2, 6, (0, 1, 2), split([0, 1, 2], comp=0.04, comm=0.005))
    assert slow.probed_joiner(3, {0: SLOW, 1: SLOW, 2: SLOW})[0] is False  # type: ignore[index]
    assert slow.held(3)
    assert slow.probed_joiner(3, {0: FAST, 1: 0.003, 2: FAST})[0] is True  # type: ignore[index]
    assert not slow.held(3)


def test_one_noisy_probe_fences_nobody() -> None:
    """A replica that looks slow in one probe only (descheduled while it answered every peer) is not fenced."""
    slow = SlowLinks(factor=1.5, steps=1)
    members = (0, 1, 2, 3)
    for looks_slow in ({2}, set(), {2}, {1}):
        while not slow.observe(1, 0, members, split(list(members))):  # (a probe naming nobody backs off)
            pass
        slow.started(0.0)
        for r, times in probes(list(members), looks_slow).items():
            slow.answered(r, times)
        v = slow.settle(0.1, members, 1)
        assert v is not None and not v.fenced
    assert not slow.fenced


def test_a_probe_that_fences_nobody_backs_the_next_one_off_and_silence_ends_the_wait() -> None:
    slow = SlowLinks(factor=1.5, steps=2)
    members = (0, 1, 2)
    assert [slow.observe(1, s, members, split(list(members))) for s in (0, 1)] == [False, True]
    slow.started(0.0)
    for r, times in probes(list(members), {0, 1, 2}).items():  # every link slow: nobody is fenced
        slow.answered(r, times)
    v = slow.settle(0.1, members, 1)
    assert v is not None and not v.fenced
    assert [slow.observe(1, s, members, split(list(members))) for s in range(2, 6)] == [False, False, False, True]
    slow.started(1.0)
    slow.answered(0, {1: FAST, 2: FAST})
    assert slow.settle(1.0 + GATHER_S / 2, members, 1) is None  # 1 and 2 have not answered yet
    assert slow.settle(1.0 + GATHER_S, members, 1) is not None  # their silence ends the wait


def test_the_rule_off_probes_nobody() -> None:
    slow = SlowLinks(factor=0)
    assert not [s for s in range(20) if slow.observe(1, s, (0, 1, 2), split([0, 1, 2]))]
    with pytest.raises(ValueError):
        SlowLinks(factor=1.0)


def test_the_vote_carries_the_step_split() -> None:
    b = Ballot.make(1, 0, [1, 0], 0.01, comp_s=0.02, comm_s=0.0)
    assert Ballot.from_wire({**b.to_wire(), "id": 1}) == b
    assert (b.comp_s, b.comm_s) == (0.02, 0.0)
    both = Ballot.of_ranks([b, Ballot.make(1, 0, [0, 1], 0.01, comp_s=0.03, comm_s=0.5)])
    assert (both.comp_s, both.comm_s) == (0.03, 0.5)


# ----------------------------------------------------------------- through the coordinator's rank logic


def _aggregator(replicas: int) -> RankAggregator:
    st = MembershipState(expected=replicas, min_members=1, store_host="h", store_port=1, ack_timeout_s=60.0,
                         max_replicas=replicas, slow=SlowLinks(1.5, 3))
    agg = RankAggregator(st, token=TOKEN, heartbeat_timeout_s=60.0, register_timeout_s=10.0)
    for r in range(replicas):
        _register(agg, r, join=False)
    return agg


def _register(agg: RankAggregator, r: int, join: bool, now: float = 0.0) -> list[Any]:
    agg.on_open(f"r{r}", "peer", now)
    return agg.on_message(f"r{r}", msg("register", id=1, token=TOKEN, replica=r, join=join,
                                       probe=f"10.0.0.{r}:7"), now)


def _commit(agg: RankAggregator, members: list[int], generation: int, step: int, now: float,
            comm: float = 1.8) -> list[Any]:
    out: list[Any] = []
    for r in members:
        out += agg.on_message(f"r{r}", msg("vote", id=100 + step, generation=generation, step=step, ids=list(range(M)),
                                           mb_s=0.015, comp_s=0.03, comm_s=comm + 0.001 * r), now)
    return out


def test_the_coordinator_probes_fences_with_the_cause_named_and_readmits_once_the_link_recovered() -> None:
    agg = _aggregator(4)
    members = [0, 1, 2, 3]
    assert not sent(_commit(agg, members, 1, 0, 1.0) + _commit(agg, members, 1, 1, 3.0), "rate")
    out = _commit(agg, members, 1, 2, 5.0)
    asked = sent(out, "rate")
    assert set(asked) == {"r0", "r1", "r2", "r3"} and logs(out, "slow_link_probe")
    assert asked["r3"] == {"type": "rate", "peers": {"0": "10.0.0.0:7", "1": "10.0.0.1:7", "2": "10.0.0.2:7"},
                           "bytes": PROBE_BYTES}
    out = []
    for r, times in probes(members, {3}).items():
        out += agg.on_message(f"r{r}", msg("rates", times={str(p): t for p, t in times.items()}), 5.5)
    first = logs(out, "slow_link")
    assert len(first) == 1 and first[0]["named"] and not first[0]["fenced"] and not logs(out, "failure_detected")
    assert set(sent(_commit(agg, members, 1, 3, 5.6), "rate")) == {"r0", "r1", "r2", "r3"}  # confirmed at once
    out = []
    for r, times in probes(members, {3}).items():
        out += agg.on_message(f"r{r}", msg("rates", times={str(p): t for p, t in times.items()}), 5.7)
    verdict = logs(out, "slow_link")
    assert len(verdict) == 1 and verdict[0]["replica"] == 3 and verdict[0]["fenced"] and verdict[0]["ratio"] > 1.5
    assert logs(out, "failure_detected") == [{"replica": 3, "cause": "slow_link", "generation": 1}]
    assert "slow link" in logs(out, "fenced")[0]["reason"]
    assert sent(out, "error")["r3"]["code"] == "fenced"
    for r in (0, 1, 2):
        agg.on_message(f"r{r}", msg("ack", generation=1), 5.6)
    assert agg.state.current is not None and agg.state.current.members == (0, 1, 2)
    # replica 3 comes back while its link is still slow: held back, asked to time its links at every scan
    _register(agg, 3, join=True, now=6.0)
    out = _commit(agg, [0, 1, 2], 2, 4, 6.5, comm=0.005)
    assert logs(out, "join_held") == [{"replica": 3, "generation": 2, "cannot_reach": [], "cause": "slow_link"}]
    assert set(sent(agg.on_tick(7.0), "rate")) == {"r3"}
    held = logs(agg.on_message("r3", msg("rates", times={"0": SLOW, "1": SLOW, "2": SLOW}), 7.2), "slow_link_held")
    assert held[0]["replica"] == 3 and held[0]["step_with_s"] > 1.5 * held[0]["step_s"]
    assert not logs(_commit(agg, [0, 1, 2], 2, 5, 7.5, comm=0.005), "generation")  # still held
    out = agg.on_message("r3", msg("rates", times={"0": FAST, "1": FAST, "2": 0.004}), 9.2)
    assert logs(out, "slow_link_cleared")[0]["replica"] == 3
    out = _commit(agg, [0, 1, 2], 2, 6, 9.5, comm=0.005)
    assert logs(out, "generation")[0]["members"] == [0, 1, 2, 3]
