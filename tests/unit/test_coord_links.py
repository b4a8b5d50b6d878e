"""The link rule (recover.coord.links): held reports of a failed generation, the smallest set to fence,
and the pairs remembered until a probe shows they connect."""

from __future__ import annotations

from recover.coord.links import KnownCuts, LinkJudge, broken_pairs, cut


def test_a_cut_between_two_replicas_fences_one_of_them_the_higher_id() -> None:
    """Replicas 1 and 2 cannot reach each other; both reach 0 and 3: one of the pair goes, never both."""
    members = [0, 1, 2, 3]
    assert cut(members, {0: [], 1: [2], 2: [1], 3: []}) == (2,)
    assert cut(members, {1: [2]}) == (2,)  # one side's word is enough to know the pair is broken
    assert cut(members, {0: [2], 1: [2], 3: [2], 2: [0]}) == (2,)
    assert cut(members, {0: [], 1: []}) == ()  # nobody named, nobody silent: nobody
    assert cut(members, {0: [9, 0]}) == ()  # not members, or itself: nobody


def test_the_smallest_set_that_leaves_a_fully_connected_group() -> None:
    members = [0, 1, 2, 3, 4]
    # 0-1, 0-2 and 3-4 broken: {0, 4} leaves {1, 2, 3} fully connected (two fenced, not three)
    assert cut(members, {0: [1, 2], 3: [4]}) == (0, 4)
    # a reporter that reaches hardly anyone is fenced alone (its own link is down)
    assert cut([0, 1, 2, 3], {3: [0, 1], 0: [3]}) == (3,)
    assert cut([0, 1, 2, 3], {0: [1, 2, 3], 1: [0]}) == (0,)
    assert cut([0, 1], {0: [1]}) == (1,)  # two members: no majority to tell, the higher id goes


def test_a_member_that_does_not_report_is_a_suspect() -> None:
    # nobody named anyone, but 2 never reported: it is the suspect
    assert cut([0, 1, 2, 3], {0: [], 1: [], 3: []}, silent=(2,)) == (2,)
    # a tie between the two sides of a cut goes to the silent one, even with the lower id
    assert cut([0, 1, 2, 3], {0: [], 2: [1], 3: []}, silent=(1,)) == (1,)


def test_the_rule_is_deterministic_and_greedy_beyond_the_exact_limit() -> None:
    members = list(range(40))
    unreachable = {r: [r + 20] for r in range(20)}  # 20 disjoint broken pairs: 20 fenced, the higher of each
    assert cut(members, unreachable) == tuple(range(20, 40))
    assert broken_pairs(members, unreachable)[0] == (0, 20)


def test_reports_wait_for_every_member_then_are_judged_and_handed_back() -> None:
    judge: LinkJudge[str] = LinkJudge(grace_s=5.0)
    judge.hold(3, 0, "r0", [2], 1.0)
    judge.hold(3, 1, "r1", [2], 1.5)
    assert judge.holds(3) and not judge.holds(2)
    assert judge.settle(2.0, 3, True, [0, 1, 2]) == []  # replica 2 has not reported
    judge.hold(3, 2, "r2", [0, 1], 2.5)
    (v,) = judge.settle(2.5, 3, True, [0, 1, 2])
    assert v.judged and v.fenced == (2,) and v.unreachable == {0: [2], 1: [2], 2: [0, 1]}
    assert v.broken == ((0, 2), (1, 2)) and v.silent == ()
    assert v.reports == {0: ["r0"], 1: ["r1"], 2: ["r2"]}
    assert judge.settle(3.0, 3, True, [0, 1, 2]) == []


def test_the_grace_ends_the_wait_and_a_stall_moves_it_on() -> None:
    judge: LinkJudge[str] = LinkJudge(grace_s=5.0)
    judge.hold(1, 0, "r0", [1], 0.0)
    judge.pause(2.0)
    assert judge.settle(6.0, 1, True, [0, 1, 2, 3]) == []
    (v,) = judge.settle(7.0, 1, True, [0, 1, 2, 3])
    assert v.judged and v.fenced == (1,) and v.silent == (1, 2, 3)


def test_reports_of_a_generation_no_longer_current_and_healthy_are_handed_back_unjudged() -> None:
    judge: LinkJudge[str] = LinkJudge(grace_s=5.0)
    judge.hold(1, 0, "a", [1], 0.0)
    judge.hold(2, 0, "b", [1], 0.0)
    old, failing = judge.settle(0.1, 2, False, [0, 1])
    assert (old.generation, old.judged, old.fenced, old.reports) == (1, False, (), {0: ["a"]})
    assert (failing.generation, failing.judged, failing.fenced) == (2, False, ())


def test_known_cuts_block_a_pair_until_a_probe_shows_it_connects() -> None:
    cuts = KnownCuts()
    cuts.add([(2, 1)])
    assert cuts.blocked(2, {0, 1, 3}) == [1] and cuts.blocked(1, [2]) == [2] and cuts.blocked(0, [1, 2]) == []
    assert cuts.connected(2, [0, 3]) == []  # reaching others says nothing of the pair
    assert cuts.connected(2, [1]) == [(1, 2)]
    assert cuts.blocked(2, {1}) == []
