"""The first generation waits for the expected replicas at most ``start_timeout_s`` (coord/state.py)."""

from __future__ import annotations

from recover.coord.actions import Log
from recover.coord.state import MembershipState


def _state(min_members: int = 2) -> MembershipState:
    return MembershipState(expected=3, min_members=min_members, store_host="h", store_port=1, ack_timeout_s=1,
                           start_timeout_s=10.0)


def _logged(acts: list, kind: str) -> list[dict]:
    return [a.fields for a in acts if isinstance(a, Log) and a.kind == kind]


def test_the_first_generation_forms_without_a_replica_that_never_registers() -> None:
    st = _state()
    st.on_register(0, False, 1, now=100.0)
    st.on_register(2, False, 2, now=103.0)
    assert st.on_tick(109.9) == [] and st.current is None
    acts = st.on_tick(110.0)  # 10 s after the first registration
    assert _logged(acts, "start_timeout") == [{"registered": [0, 2], "missing": [1], "timeout_s": 10.0}]
    assert st.current is not None and st.current.members == (0, 2)
    st.on_register(1, False, 3, now=111.0)  # it came after all: it joins at a step boundary
    assert 1 in st.pending_join


def test_with_fewer_than_min_members_registered_it_waits_on() -> None:
    st = _state(min_members=2)
    st.on_register(0, False, 1, now=0.0)
    st.on_register(1, False, 2, now=1.0)
    st.on_dead(1, "connection_closed", now=2.0)  # registered, then exited before the first generation
    assert st.on_tick(60.0) == [] and st.current is None
    st.on_register(2, False, 3, now=61.0)
    acts = st.on_tick(61.0)
    assert st.current is not None and st.current.members == (0, 2) and _logged(acts, "start_timeout")
