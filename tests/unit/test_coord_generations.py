"""What a replica knows of the generations (recover.coord.generations), fed pushes in arrival order."""

from __future__ import annotations

from recover.coord.generations import Generations
from recover.coord.protocol import Membership


def gen(g: int, *members: int) -> Membership:
    return Membership(g, members, "127.0.0.1", 1, step=0)


def test_a_failing_push_is_a_notice_and_the_next_generation_names_the_dead() -> None:
    known = Generations()
    assert known.newest is None and known.admitted(1) is None and known.dead_since(1) == ()
    known.formed(gen(1, 0, 1, 2), now=10.0)
    assert not known.notice(1) and known.newer_than(1) is None
    known.failing(1, now=11.0)
    assert known.notice(1) and known.notice_time(1) == 11.0 and not known.notice(2)
    known.formed(gen(2, 0, 2), now=12.0)
    assert known.newer_than(1) == gen(2, 0, 2) and known.dead_since(1) == (1,)
    assert known.admitted(1) == gen(1, 0, 1, 2) and known.admitted(2) == gen(2, 0, 2)
    assert known.notice_time(1) == 11.0  # the first time it was learnt stays


def test_a_generation_passed_over_is_noticed_when_a_newer_one_forms_and_a_late_push_never_rises() -> None:
    known = Generations()
    known.formed(gen(1, 0, 1), now=1.0)
    known.formed(gen(3, 0), now=5.0)  # generation 2 formed and failed before this process heard of it
    assert known.notice(1) and known.notice(2) and known.notice_time(2) == 5.0 and not known.notice(3)
    known.formed(gen(2, 0, 1), now=6.0)  # a late push of an older generation
    assert known.latest == 3 and known.newest == gen(3, 0) and known.of(2) == gen(2, 0, 1)
    assert known.dead_since(2) == (1,)
