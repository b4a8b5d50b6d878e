"""The rule "the P ranks of a replica are one member" (recover.coord.member) and the Ballot it merges."""

from __future__ import annotations

import math

import pytest

from recover.coord.actions import Refused
from recover.coord.member import Agreed, Disagreed, Member
from recover.coord.protocol import Ballot


def test_a_ballot_sorts_its_ids_keeps_only_a_real_speed_and_round_trips_the_wire() -> None:
    b = Ballot.make(2, 7, [3, 1, 2], mb_s=0.5, stop=True, fp="ab", audit={"id": 1, "fp": "x", "norm": 1.0})
    assert b.ids == (1, 2, 3) and b.key == (2, 7, (1, 2, 3))
    assert Ballot.from_wire({**b.to_wire(), "id": 9}) == b
    leave = Ballot.make(2, 7, [1], leave=True)
    assert leave.to_wire()["leave"] is True and Ballot.from_wire({**leave.to_wire(), "id": 9}) == leave
    for bad in (0.0, -1.0, math.inf, math.nan, None):
        assert Ballot.make(1, 0, [0], mb_s=bad).mb_s is None
        assert "mb_s" not in Ballot.make(1, 0, [0], mb_s=bad).to_wire()
    assert Ballot.make(1, 0, [0]).to_wire() == {"type": "vote", "generation": 1, "step": 0, "ids": [0]}


def test_ranks_ballots_merge_into_the_replicas_slowest_speed_any_stop_and_lane_fingerprints() -> None:
    ranks = [Ballot.make(1, 4, [0, 1], 0.25, fp="a"), Ballot.make(1, 4, [1, 0], 0.5, stop=True, fp="b"),
             Ballot.make(1, 4, [0, 1], None, fp="c", audit={"id": 0})]
    assert Ballot.of_ranks(ranks) == Ballot(1, 4, (0, 1), 0.5, True, "a|b|c", None)  # no audit for P > 1
    assert Ballot.of_ranks([ranks[0], Ballot.make(1, 4, [0, 1])]).fp is None  # not every lane sent one
    assert Ballot.of_ranks([ranks[0], Ballot.make(1, 4, [0, 1], leave=True)]).leave  # one rank's SIGTERM: all leave
    assert not Ballot.of_ranks(ranks).leave
    assert Ballot.of_ranks([ranks[2]]) is ranks[2]  # one rank: its ballot, audit and all


def test_registration_completes_once_every_rank_is_in_and_refuses_mismatches() -> None:
    m: Member[str] = Member(4, 3, join=False)
    assert m.register(2, 3, False, "c") is None and m.register(0, 3, False, "a") is None
    with pytest.raises(Refused) as dup:
        m.register(2, 3, False, "c2")
    assert dup.value.code == "duplicate_rank"
    for ranks, join in ((2, False), (3, True)):
        with pytest.raises(Refused) as bad:
            m.register(1, ranks, join, "b")
        assert bad.value.code == "rank_mismatch"
    assert not m.registered
    assert m.register(1, 3, False, "b") == ["a", "b", "c"] and m.registered


def test_one_register_for_every_rank_completes_at_once() -> None:
    m: Member[str] = Member(0, 3, join=True)
    assert m.register(None, 3, True, "relay") == ["relay"]
    with pytest.raises(Refused):
        m.register(None, 3, True, "again")


def test_an_ack_counts_once_every_rank_acked_that_generation() -> None:
    m: Member[str] = Member(0, 3, join=False)
    assert not m.ack((0,), 2) and not m.ack((1,), 2) and not m.ack((0,), 3)
    assert m.ack((2,), 2)
    assert not m.ack((1,), 3)  # the acks of 2 were forgotten with it, those of 3 kept
    assert m.ack((2,), 3)
    assert m.ack((0, 1, 2), 5)  # a relay's ack speaks for every rank


def test_alike_votes_are_one_vote_with_every_handle_in_rank_order() -> None:
    m: Member[tuple[str, int]] = Member(0, 3, join=False)
    assert m.vote((2,), ("r2", 12), Ballot.make(1, 0, [0, 1], 0.1)) is None
    assert m.vote((0,), ("r0", 10), Ballot.make(1, 0, [1, 0], 0.3)) is None
    with pytest.raises(Refused) as dup:
        m.vote((0,), ("r0", 11), Ballot.make(1, 0, [0, 1]))
    assert dup.value.code == "duplicate_vote"
    got = m.vote((1,), ("r1", 11), Ballot.make(1, 0, [0, 1], 0.2))
    assert got == Agreed(Ballot(1, 0, (0, 1), 0.3), [("r0", 10), ("r1", 11), ("r2", 12)])
    assert m.held == {}


def test_ranks_that_vote_differently_hand_back_every_held_vote() -> None:
    m: Member[str] = Member(0, 3, join=False)
    m.vote((0,), "a", Ballot.make(1, 0, [0, 1]))
    got = m.vote((2,), "c", Ballot.make(1, 0, [0]))
    assert isinstance(got, Disagreed) and list(got.held) == [0, 2] and got.held[2] == ("c", Ballot.make(1, 0, [0]))
    assert m.held == {}


def test_one_vote_for_every_rank_is_the_members_without_an_audit() -> None:
    m: Member[str] = Member(0, 2, join=False)
    got = m.vote((0, 1), "relay", Ballot.make(1, 0, [0], 0.1, audit={"id": 0}))
    assert got == Agreed(Ballot.make(1, 0, [0], 0.1), ["relay"])
    one: Member[str] = Member(1, 1, join=False)
    assert one.vote((0,), "x", Ballot.make(1, 0, [0], audit={"id": 0})) == \
        Agreed(Ballot.make(1, 0, [0], audit={"id": 0}), ["x"])


def test_held_votes_of_ended_generations_are_handed_back_once_per_handle() -> None:
    m: Member[str] = Member(0, 4, join=False)
    m.vote((0, 1), "relay", Ballot.make(1, 0, [0]))  # one handle for two ranks
    m.vote((2,), "c", Ballot.make(1, 0, [0]))
    assert m.abort_votes(1) == [] and len(m.held) == 3
    assert m.abort_votes(2) == [("relay", 1), ("c", 1)] and m.held == {}
    m.vote((3,), "d", Ballot.make(2, 1, [0]))
    assert m.abort_votes(None) == [("d", 2)]
