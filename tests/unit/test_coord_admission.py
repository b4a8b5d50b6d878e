"""Admitted joiners must start their rendezvous in time (recover.coord.admission), driven directly."""

from __future__ import annotations

import pytest

from recover.coord.admission import JoinWatch
from recover.coord.protocol import Membership
from recover.coord.sealing import sealed_key


def gen(g: int, members: tuple[int, ...], joined: tuple[int, ...] = ()) -> Membership:
    return Membership(g, members, "h", 1, step=0, joined=joined, secret=f"s{g}")


def watch_join(lanes: int = 1) -> JoinWatch:
    """Generation 1 of replicas 0 and 1, then generation 2 admitting replica 2 at t = 10."""
    w = JoinWatch(ready_s=3.0)
    w.formed(gen(1, (0, 1)), lambda r: lanes, 0.0)
    w.formed(gen(2, (0, 1, 2), joined=(2,)), lambda r: lanes, 10.0)
    return w


def test_a_joiner_that_never_rendezvouses_is_due_at_its_deadline_and_only_then() -> None:
    w = watch_join()
    assert w.watching == [2]
    assert w.due(12.9, lambda key: False) == []
    assert w.due(13.0, lambda key: False) == [2]
    assert w.watching == [] and w.due(20.0, lambda key: False) == []  # told once


def test_a_joiner_that_published_its_probe_key_under_the_secret_prefix_is_ready() -> None:
    asked: list[str] = []
    w = watch_join()
    key = sealed_key("s2", "gen2", "probe/2")
    assert w.due(13.0, lambda k: asked.append(k) or k == key) == []
    assert asked == [key]  # one lookup, at the deadline
    for other in ("gen2/probe/2", sealed_key("s1", "gen2", "probe/2")):  # in the clear, or another secret's
        assert watch_join().due(13.0, lambda k, other=other: k == other) == [2]


def test_every_lane_of_a_joiner_of_several_ranks_must_publish() -> None:
    lane0 = sealed_key("s2", "gen2/lane0", "probe/2")
    assert watch_join(lanes=2).due(13.0, lambda key: key == lane0) == [2]
    both = {lane0, sealed_key("s2", "gen2/lane1", "probe/2")}
    assert watch_join(lanes=2).due(13.0, both.__contains__) == []


def test_a_joiner_moved_on_by_a_failure_may_publish_in_the_later_generation() -> None:
    w = watch_join()
    w.formed(gen(3, (0, 2), joined=(2,)), lambda r: 1, 11.0)  # replica 1 died while generation 2 formed
    assert w.watching == [2]
    assert w.due(13.0, lambda key: key == sealed_key("s3", "gen3", "probe/2")) == []


def test_members_before_and_the_first_generation_are_never_watched_and_leavers_are_dropped() -> None:
    w = JoinWatch(3.0)
    w.formed(gen(5, (0, 1, 2), joined=(1, 2)), lambda r: 1, 0.0)  # a restarted coordinator's rebuild
    w.formed(gen(6, (0, 1), joined=(1,)), lambda r: 1, 1.0)  # a failure: 1 was a member already
    assert w.watching == []
    w.formed(gen(7, (0, 1, 3), joined=(1, 3)), lambda r: 1, 2.0)
    assert w.watching == [3]
    w.formed(gen(8, (0, 1)), lambda r: 1, 2.5)  # 3 died before its deadline: nothing to fence
    assert w.watching == [] and w.due(10.0, lambda key: False) == []
    w.formed(gen(9, (0, 1, 4), joined=(4,)), lambda r: None, 3.0)  # 4 is no longer registered
    assert w.watching == []


def test_a_coordinator_stall_moves_the_deadlines_on() -> None:
    w = watch_join()
    w.pause(5.0)
    assert w.due(17.9, lambda key: False) == [] and w.due(18.0, lambda key: False) == [2]
    with pytest.raises(ValueError):
        JoinWatch(0.0)
