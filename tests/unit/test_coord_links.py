"""The link rule (recover.coord.links): held reports of a timed-out collective, and who they implicate."""

from __future__ import annotations

from recover.coord.links import LinkJudge, implicated


def test_the_replica_most_reporters_cannot_reach_is_implicated_ties_to_the_higher_id() -> None:
    members = [0, 1, 2, 3]
    assert implicated(members, {0: [2], 1: [2], 3: [2], 2: [0]}) == 2
    assert implicated(members, {0: [1], 1: [0]}) == 1
    assert implicated(members, {0: [], 1: []}) is None
    assert implicated(members, {0: [9, 0]}) is None  # not members, or itself: nobody


def test_a_reporter_that_cannot_reach_half_the_others_implicates_itself() -> None:
    assert implicated([0, 1, 2, 3], {3: [0, 1], 0: [3]}) == 3
    assert implicated([0, 1], {0: [1]}) == 1  # two members: no majority to tell, the named one goes


def test_reports_wait_for_every_member_then_are_judged_and_handed_back() -> None:
    judge: LinkJudge[str] = LinkJudge(grace_s=5.0)
    judge.hold(3, 0, "r0", [2], 1.0)
    judge.hold(3, 1, "r1", [2], 1.5)
    assert judge.settle(2.0, 3, True, [0, 1, 2]) == []  # replica 2 has not reported
    judge.hold(3, 2, "r2", [0, 1], 2.5)
    (v,) = judge.settle(2.5, 3, True, [0, 1, 2])
    assert v.judged and v.victim == 2 and v.unreachable == {0: [2], 1: [2], 2: [0, 1]}
    assert v.reports == {0: ["r0"], 1: ["r1"], 2: ["r2"]}
    assert judge.settle(3.0, 3, True, [0, 1, 2]) == []


def test_the_grace_ends_the_wait_and_a_stall_moves_it_on() -> None:
    judge: LinkJudge[str] = LinkJudge(grace_s=5.0)
    judge.hold(1, 0, "r0", [1], 0.0)
    judge.pause(2.0)
    assert judge.settle(6.0, 1, True, [0, 1, 2, 3]) == []
    (v,) = judge.settle(7.0, 1, True, [0, 1, 2, 3])
    assert v.judged and v.victim == 1


def test_reports_of_a_generation_no_longer_current_and_healthy_are_handed_back_unjudged() -> None:
    judge: LinkJudge[str] = LinkJudge(grace_s=5.0)
    judge.hold(1, 0, "a", [1], 0.0)
    judge.hold(2, 0, "b", [1], 0.0)
    old, failing = judge.settle(0.1, 2, False, [0, 1])
    assert (old.generation, old.judged, old.victim, old.reports) == (1, False, None, {0: ["a"]})
    assert (failing.generation, failing.judged, failing.victim) == (2, False, None)
