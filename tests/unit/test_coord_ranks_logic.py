"""The coordinator's connection and rank-aggregation logic, driven directly (pure, no sockets, ms).

Connection keys are plain strings: ``"a1"`` is rank 1 of replica 0 (``a``), ``"b0"`` rank 0 of
replica 1 (``b``), and so on.
"""

from __future__ import annotations

from typing import Any

from recover.coord.actions import Log
from recover.coord.liveness import Liveness
from recover.coord.protocol import Ballot, ProtocolError
from recover.coord.ranks import LINK_GRACE_S, Close, Out, RankAggregator, SendTo
from recover.coord.state import MembershipState
from recover.names import Event

TOKEN = "t0ken"
IDS = [0, 1, 2, 3]


def make(expected: int = 2, hb: float = 1.0, register_timeout: float = 10.0) -> RankAggregator:
    st = MembershipState(expected=expected, min_members=1, store_host="h", store_port=1, ack_timeout_s=hb,
                         max_replicas=4)
    return RankAggregator(st, token=TOKEN, heartbeat_timeout_s=hb, register_timeout_s=register_timeout)


def register(agg: RankAggregator, conn: str, replica: int, rank: int = 0, ranks: int = 1, *, join: bool = False,
             rid: int = 1, now: float = 0.0, token: str = TOKEN, pid: int | None = None) -> list[Out]:
    agg.on_open(conn, f"peer-{conn}", now)
    return agg.on_message(conn, {"type": "register", "id": rid, "token": token, "replica": replica, "join": join,
                                 "rank": rank, "ranks": ranks, **({"pid": pid} if pid is not None else {})}, now)


def replica(agg: RankAggregator, name: str, rid: int, ranks: int, now: float = 0.0, **kw: Any) -> list[Out]:
    """Registers every rank of replica ``rid`` (connections ``name0``, ``name1``...); the last output."""
    out: list[Out] = []
    for k in range(ranks):
        out = register(agg, f"{name}{k}", rid, k, ranks, now=now, **kw)
    return out


def msg(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def vote(agg: RankAggregator, conn: str, rid: int, ids: list[int] = IDS, generation: int = 1, step: int = 0,
         now: float = 0.0, mb_s: float | None = None) -> list[Out]:
    speed = {} if mb_s is None else {"mb_s": mb_s}
    return agg.on_message(conn, msg("vote", id=rid, generation=generation, step=step, ids=ids, **speed), now)


def sent(out: list[Out], kind: str) -> dict[Any, dict[str, Any]]:
    """Connection -> the message of type ``kind`` queued on it (each connection gets at most one here)."""
    got = [(a.conn, a.msg) for a in out if isinstance(a, SendTo) and a.msg["type"] == kind]
    assert len({c for c, _ in got}) == len(got), f"a connection got two {kind} messages: {got}"
    return dict(got)


def closed(out: list[Out]) -> list[Any]:
    return [a.conn for a in out if isinstance(a, Close)]


def logs(out: list[Out], kind: str) -> list[dict[str, Any]]:
    return [a.fields for a in out if isinstance(a, Log) and a.kind == kind]


def two_replicas(agg: RankAggregator) -> None:
    """Replica 0 of two ranks (a0, a1) and replica 1 of one rank (b0): generation 1 = [0, 1]."""
    replica(agg, "a", 0, 2)
    out = replica(agg, "b", 1, 1)
    assert set(sent(out, "membership")) == {"a0", "a1", "b0"}


# ------------------------------------------------------------------ register


def test_single_rank_replicas_register_at_once_and_get_the_generation() -> None:
    agg = make(expected=2)
    out = register(agg, "a0", 0, rid=7)
    assert sent(out, "ok") == {"a0": {"type": "ok", "re": 7, "generation": 0}}
    assert logs(out, "register") == [{"replica": 0, "join": False}] and logs(out, "rank_register") == []
    out = register(agg, "b0", 1)
    wire = sent(out, "membership")
    assert set(wire) == {"a0", "b0"}
    assert wire["a0"]["membership"]["generation"] == 1 and wire["a0"]["membership"]["members"] == [0, 1]
    assert agg.snapshot()["live"] == [0, 1] and agg.snapshot()["registering"] == {}


def test_register_waits_for_every_rank_and_replies_with_each_ranks_own_id() -> None:
    agg = make(expected=2)
    out = register(agg, "a0", 0, 0, 2, rid=5)
    assert [a for a in out if not isinstance(a, Log)] == []  # no reply until rank 1 is in
    assert logs(out, "rank_register") == [{"replica": 0, "rank": 0, "ranks": 2, "registered": 1}]
    assert agg.snapshot()["registering"] == {0: [0]} and agg.snapshot()["live"] == []
    out = register(agg, "a1", 0, 1, 2, rid=9)
    assert {c: m["re"] for c, m in sent(out, "ok").items()} == {"a0": 5, "a1": 9}
    assert logs(out, "register") == [{"replica": 0, "join": False}]  # the state heard of it once
    assert agg.snapshot()["live"] == [0] and agg.snapshot()["registering"] == {}
    out = replica(agg, "b", 1, 2)
    assert set(sent(out, "membership")) == {"a0", "a1", "b0", "b1"}
    assert agg.snapshot()["generation"] == 1 and agg.snapshot()["members"] == [0, 1]


def test_three_rank_replica_gets_the_membership_push_on_every_rank() -> None:
    agg = make(expected=2)
    replica(agg, "a", 0, 3)
    out = replica(agg, "b", 1, 1)
    assert set(sent(out, "membership")) == {"a0", "a1", "a2", "b0"}
    assert set(sent(out, "ok")) == {"b0"}


def test_mismatched_or_duplicate_ranks_are_refused_and_closed() -> None:
    agg = make(expected=2)
    register(agg, "a0", 0, 0, 2)
    cases = [("x1", dict(rank=1, ranks=3), "rank_mismatch"), ("x2", dict(rank=1, ranks=2, join=True), "rank_mismatch"),
             ("x3", dict(rank=0, ranks=2), "duplicate_rank"), ("x4", dict(rank=2, ranks=2), "bad_rank")]
    for conn, kw, code in cases:
        out = register(agg, conn, 0, rid=4, **kw)
        assert sent(out, "error")[conn]["code"] == code and sent(out, "error")[conn]["re"] == 4
        assert closed(out) == [conn]
        assert [(e["code"], e["closed"], e["peer"]) for e in logs(out, "refused")] == [(code, True, f"peer-{conn}")]
    assert agg.snapshot()["registering"] == {0: [0]}  # the refusals left replica 0 waiting
    out = register(agg, "a1", 0, 1, 2)
    assert set(sent(out, "ok")) == {"a0", "a1"}
    out = register(agg, "y0", 0, 0, 1)
    assert sent(out, "error")["y0"]["code"] == "duplicate_replica" and closed(out) == ["y0"]


def test_unauthenticated_connections_are_refused_and_closed() -> None:
    agg = make()
    out = register(agg, "w", 0, token="wrong")
    assert sent(out, "error")["w"]["code"] == "unauthorized" and closed(out) == ["w"]
    agg.on_open("h", "peer-h", 0.0)
    out = agg.on_message("h", msg("hb"), 0.0)
    assert sent(out, "error")["h"]["code"] == "unauthenticated" and closed(out) == ["h"]
    agg.on_open("g", "peer-g", 0.0)
    out = agg.on_bad_frame("g", ProtocolError("malformed", "not JSON"), 0.0)
    assert sent(out, "error")["g"]["code"] == "malformed" and closed(out) == ["g"]
    agg.on_open("slow", "peer-slow", 0.0)
    assert agg.on_tick(5.0) == []
    out = agg.on_tick(10.5)
    assert sent(out, "error")["slow"]["code"] == "register_timeout" and closed(out) == ["slow"]
    assert agg.snapshot()["live"] == []


def test_bad_frames_from_a_registered_rank_are_refused_without_closing_unless_out_of_sync() -> None:
    agg = make()
    two_replicas(agg)
    out = agg.on_bad_frame("a0", ProtocolError("malformed", "bad field"), 0.1)
    assert sent(out, "error")["a0"]["code"] == "malformed" and closed(out) == []
    out = agg.on_bad_frame("a1", ProtocolError("bad_magic", "garbage"), 0.2)
    assert closed(out)[0] == "a1" and sent(out, "error")["a0"]["code"] == "fenced"
    assert logs(out, "failure_detected") == [{"replica": 0, "cause": "refused", "generation": 1}]


def test_requests_of_a_replica_still_waiting_for_ranks_are_refused() -> None:
    agg = make()
    register(agg, "a0", 0, 0, 2)
    out = vote(agg, "a0", 3)
    assert sent(out, "error") == {"a0": {"type": "error", "re": 3, "code": "not_registered",
                                         "message": "replica 0 waits for its other ranks (1 of 2 registered)"}}
    assert closed(out) == []
    out = agg.on_message("a0", msg("register", id=4, token=TOKEN, replica=0, join=False), 0.0)
    assert sent(out, "error")["a0"]["code"] == "already_registered"


# -------------------------------------------------------------- ack, vote


def test_ack_reaches_the_state_once_every_rank_acked() -> None:
    agg = make()
    two_replicas(agg)
    assert agg.on_message("b0", msg("report", id=8, generation=1, suspects=[]), 0.1) == []  # held: the link rule
    out = agg.on_message("a0", msg("report", id=3, generation=1, suspects=[]), 0.1)  # every member reported
    assert sent(out, "ok") == {"b0": {"type": "ok", "re": 8, "generation": 1},
                               "a0": {"type": "ok", "re": 3, "generation": 1}}
    assert set(sent(out, "failing")) == {"a0", "a1", "b0"}  # a push goes to every rank
    assert agg.on_message("a0", msg("ack", generation=1), 0.2) == []
    assert agg.on_message("b0", msg("ack", generation=1), 0.3) == []  # a1 has not acked yet
    assert agg.snapshot()["generation"] == 1 and agg.snapshot()["failing"]
    out = agg.on_message("a1", msg("ack", generation=1), 0.4)
    wire = sent(out, "membership")
    assert set(wire) == {"a0", "a1", "b0"}
    assert wire["a1"]["membership"]["generation"] == 2 and wire["a1"]["membership"]["members"] == [0, 1]


def test_vote_reaches_the_state_once_all_ranks_voted_and_replies_carry_each_ranks_id() -> None:
    agg = make()
    two_replicas(agg)
    assert vote(agg, "a0", 11) == []
    assert agg.slots[0].member.held == {0: Ballot.make(1, 0, IDS)}
    assert vote(agg, "a1", 22) == []  # replica 0 voted; the state waits for replica 1
    out = vote(agg, "b0", 33)
    assert {c: m["re"] for c, m in sent(out, "committed").items()} == {"a0": 11, "a1": 22, "b0": 33}
    assert all(m["step"] == 0 and m["new_generation"] is None for m in sent(out, "committed").values())
    assert logs(out, "commit") == [{"generation": 1, "step": 0, "ids": 4}]
    assert agg.snapshot()["committed_step"] == 0 and agg.slots[0].member.held == {}


def test_single_rank_and_stale_votes_go_to_the_state_at_once_for_that_rank_alone() -> None:
    agg = make()
    two_replicas(agg)
    out = vote(agg, "a1", 5, generation=0)
    assert sent(out, "error") == {"a1": {"type": "error", "re": 5, "code": "stale_generation",
                                         "message": "vote of replica 0 for generation 0; current is 1"}}
    assert closed(out) == [] and agg.slots[0].member.held == {}
    assert vote(agg, "b0", 6) == []  # P = 1: straight to the state, which waits for replica 0
    out = vote(agg, "b0", 7)
    assert sent(out, "error")["b0"]["code"] == "duplicate_vote"


def test_ranks_voting_differently_fence_their_replica() -> None:
    agg = make()
    two_replicas(agg)
    vote(agg, "a0", 1)
    out = vote(agg, "a1", 2, ids=IDS[:-1])
    assert logs(out, "rank_vote_disagreement")[0]["replica"] == 0
    reason = "the ranks of replica 0 voted differently in generation 1"
    assert sent(out, "error") == {c: {"type": "error", "re": None, "code": "fenced", "message": reason}
                                  for c in ("a0", "a1")}
    assert closed(out) == ["a0", "a1"]
    assert logs(out, "failure_detected") == [{"replica": 0, "cause": "rank_disagreement", "generation": 1}]
    assert set(sent(out, "failing")) == {"b0"}
    assert agg.snapshot()["live"] == [1]


def test_failing_push_answers_buffered_rank_votes_aborted() -> None:
    agg = make()
    two_replicas(agg)
    vote(agg, "a0", 41)
    out = agg.on_closed("b0", "connection_closed", 0.5)
    assert closed(out) == ["b0"]
    assert set(sent(out, "failing")) == {"a0", "a1"}
    assert sent(out, "aborted") == {"a0": {"type": "aborted", "re": 41, "generation": 1,
                                           "reason": "generation is failing"}}
    kinds = [a.msg["type"] for a in out if isinstance(a, SendTo) and a.conn == "a0"]
    assert kinds == ["failing", "aborted"]
    assert agg.slots[0].member.held == {}
    out = vote(agg, "a1", 42)  # a1 never voted on generation 1: the state aborts it at once
    assert sent(out, "aborted") == {"a1": {"type": "aborted", "re": 42, "generation": 1,
                                           "reason": "generation is failing"}}


# ----------------------------------------------------------- losing ranks


def test_one_rank_lost_fences_the_others_first_and_marks_the_replica_dead_once() -> None:
    agg = make()
    replica(agg, "a", 0, 3)
    replica(agg, "b", 1, 1)
    out = agg.on_closed("a1", "connection_closed", 1.0)
    why = "replica 0 rank 1 is gone (connection_closed)"
    assert out[0] == Close("a1")
    assert out[1:5] == [SendTo("a0", {"type": "error", "re": None, "code": "fenced", "message": why}), Close("a0"),
                        SendTo("a2", {"type": "error", "re": None, "code": "fenced", "message": why}), Close("a2")]
    assert logs(out, "failure_detected") == [{"replica": 0, "cause": "connection_closed", "generation": 1}]
    assert set(sent(out, "failing")) == {"b0"}
    assert agg.on_closed("a0", "connection_closed", 1.1) == []  # already fenced: nothing more
    assert agg.on_message("a2", msg("ack", generation=1), 1.1) == []
    out = agg.on_message("b0", msg("ack", generation=1), 1.2)
    assert sent(out, "membership")["b0"]["membership"]["members"] == [1]
    assert agg.snapshot()["live"] == [1]


def test_silent_rank_is_fenced_with_its_replica_after_the_heartbeat_timeout() -> None:
    agg = make(hb=1.0)
    two_replicas(agg)
    for conn in ("a0", "b0"):
        agg.on_heard(conn, 0.9)
    assert agg.on_tick(0.9) == []
    for conn in ("a0", "b0"):
        agg.on_heard(conn, 1.2)  # the others are heard (were every one silent, the coordinator would be cut off)
    out = agg.on_tick(1.5)  # a1 silent since it registered at 0.0
    assert sent(out, "error") == {
        "a1": {"type": "error", "re": None, "code": "fenced", "message": "no heartbeat for 1.500 s"},
        "a0": {"type": "error", "re": None, "code": "fenced",
               "message": "replica 0 rank 1 is gone (heartbeat_timeout: no heartbeat for 1.500 s)"}}
    assert closed(out) == ["a1", "a0"]
    assert logs(out, "fenced") == [{"replica": 0, "reason": "no heartbeat for 1.500 s"}]
    assert logs(out, "failure_detected") == [{"replica": 0, "cause": "heartbeat_timeout", "generation": 1}]


def test_ranks_waiting_for_their_replica_do_not_time_out_on_heartbeats() -> None:
    agg = make(hb=1.0)
    register(agg, "a0", 0, 0, 2)
    assert agg.on_tick(5.0) == []
    out = register(agg, "a1", 0, 1, 2, now=5.0)
    assert set(sent(out, "ok")) == {"a0", "a1"}
    assert agg.on_tick(5.9) == []  # the heartbeat clock starts with the ok reply


def test_replica_losing_a_rank_before_all_registered_is_abandoned_quietly() -> None:
    agg = make()
    register(agg, "a0", 0, 0, 3)
    register(agg, "a1", 0, 1, 3)
    out = agg.on_message("a0", msg("bye"), 0.1)
    assert out[0] == Close("a0") and closed(out) == ["a0", "a1"]
    assert sent(out, "error")["a1"]["message"] == "replica 0 rank 0 is gone (left)"
    assert logs(out, "register_abandoned") == [{"replica": 0, "ranks": 3, "registered": [0, 1], "cause": "left"}]
    assert logs(out, "failure_detected") == []
    assert agg.snapshot()["registering"] == {}
    out = replica(agg, "c", 0, 3)  # it can come back whole
    assert set(sent(out, "ok")) == {"c0", "c1", "c2"}


def test_a_joining_replica_of_two_ranks_is_admitted_at_the_next_commit() -> None:
    agg = make()
    two_replicas(agg)
    out = replica(agg, "j", 2, 2, join=True)
    assert set(sent(out, "ok")) == {"j0", "j1"} and agg.snapshot()["pending_join"] == [2]
    vote(agg, "a0", 1)
    vote(agg, "a1", 2)
    out = vote(agg, "b0", 3)
    assert {c: m["new_generation"] for c, m in sent(out, "committed").items()} == {"a0": 2, "a1": 2, "b0": 2}
    wire = sent(out, "membership")
    assert set(wire) == {"a0", "a1", "b0", "j0", "j1"}
    assert wire["j1"]["membership"]["members"] == [0, 1, 2] and wire["j1"]["membership"]["joined"] == [2]


# ------------------------------------------------------------------ liveness

def three_replicas(agg: RankAggregator, now: float = 0.0) -> None:
    for rid in range(3):
        replica(agg, f"r{rid}_", rid, 1, now=now)


def test_a_replica_that_stops_advancing_while_others_wait_is_fenced_as_hung() -> None:
    st = MembershipState(expected=3, min_members=1, store_host="h", store_port=1, ack_timeout_s=1.0)
    agg = RankAggregator(st, token=TOKEN, heartbeat_timeout_s=1.0, register_timeout_s=10.0,
                         liveness=Liveness(hang_timeout_s=2.0))
    three_replicas(agg)
    for t in (0.5, 1.0, 1.5, 2.0, 2.5):  # replicas 0 and 2 wait in a collective; 1 heartbeats, no progress
        agg.on_message("r0_0", msg("hb", progress=7, activity="wait"), t)
        agg.on_message("r2_0", msg("hb", progress=7, activity="wait"), t)
        agg.on_message("r1_0", msg("hb", progress=3, activity="compute"), t)
        for conn in ("r0_0", "r1_0", "r2_0"):
            agg.on_heard(conn, t)
    assert logs(agg.on_tick(2.4), "fenced") == []  # 1.9 s since its last progress
    out = agg.on_tick(2.6)
    assert [f["replica"] for f in logs(out, "failure_detected")] == [1]
    assert logs(out, "failure_detected")[0]["cause"] == "hung"
    assert "r1_0" in sent(out, "error") and "r1_0" in closed(out)  # told it is fenced, then closed


def test_a_timed_out_collective_fences_the_members_that_never_reached_it() -> None:
    agg = make(expected=3)
    three_replicas(agg)
    agg.on_message("r0_0", msg("hb", progress=5, activity="wait"), 0.5)
    agg.on_message("r1_0", msg("hb", progress=2, activity="compute"), 0.5)  # never reached it
    agg.on_message("r2_0", msg("hb", progress=5, activity="wait"), 0.5)
    out = agg.on_message("r0_0", msg("report", id=9, generation=1, suspects=[], timeout=True), 0.6)
    detected = logs(out, "failure_detected")
    assert [(d["replica"], d["cause"]) for d in detected] == [(1, "unreached")]
    # a report that is no timeout (a peer's connection reset) fences nobody by itself
    agg2 = make(expected=3)
    three_replicas(agg2)
    agg2.on_message("r1_0", msg("hb", progress=2, activity="compute"), 0.5)
    assert logs(agg2.on_message("r0_0", msg("report", id=9, generation=1, suspects=[]), 0.6),
                "failure_detected") == []


def test_a_replica_of_several_ranks_is_as_slow_as_its_slowest_rank() -> None:
    agg = make()
    two_replicas(agg)
    got: list[float | None] = []
    on_vote = agg.state.on_vote
    agg.state.on_vote = lambda *a, **k: got.append(a[2].mb_s) or on_vote(*a, **k)  # type: ignore[method-assign]
    for step in range(2):
        vote(agg, "a0", 10 + step, step=step, mb_s=0.25)
        vote(agg, "a1", 20 + step, step=step, mb_s=0.5 if step == 0 else None)  # rank 1 computed nothing
        vote(agg, "b0", 30 + step, step=step, mb_s=0.125)
    assert got == [0.5, 0.125, 0.25, 0.125]


def _all_waiting(agg: RankAggregator, n: int, now: float) -> None:
    for r in range(n):
        agg.on_message(f"r{r}_0", msg("hb", progress=5, activity="wait", generation=1), now)


def test_a_broken_link_fences_the_replica_the_reports_implicate() -> None:
    """Every member reached the collective that timed out: the reports, naming whom each cannot reach,
    are held until all members reported; replicas 0 and 2 cannot reach each other: 2 (the higher id of
    the tie) is fenced, and the held reports get their replies."""
    agg = make(expected=3)
    three_replicas(agg)
    _all_waiting(agg, 3, 0.5)
    out = agg.on_message("r1_0", msg("report", id=7, generation=1, suspects=[], timeout=True), 0.6)
    assert out == [] and not agg.state.failing  # held: a third party that reaches everyone
    assert agg.on_message("r0_0", msg("report", id=8, generation=1, suspects=[2], timeout=True), 0.7) == []
    out = agg.on_message("r2_0", msg("report", id=9, generation=1, suspects=[0], timeout=True), 0.8)
    assert logs(out, "link_report") == [{"generation": 1, "unreachable": {"0": [2], "1": [], "2": [0]},
                                         "broken": [[0, 2]], "silent": [], "fenced": [2]}]
    assert [(d["replica"], d["cause"]) for d in logs(out, "failure_detected")] == [(2, "link")]
    assert {c: m["re"] for c, m in sent(out, "ok").items()} == {"r0_0": 8, "r1_0": 7}
    assert agg.state.failing and "r2_0" in closed(out)


def test_a_reporter_that_reaches_hardly_anyone_implicates_itself_and_silence_ends_the_wait() -> None:
    agg = make(expected=4, hb=60.0)
    for r in range(4):
        replica(agg, f"r{r}_", r, 1)
    for r in range(4):
        agg.on_message(f"r{r}_0", msg("hb", progress=5, activity="wait", generation=1), 0.5)
    agg.on_message("r0_0", msg("report", id=3, generation=1, suspects=[1, 2, 3], timeout=True), 0.6)
    agg.on_message("r1_0", msg("report", id=4, generation=1, suspects=[0], timeout=True), 0.7)
    agg.on_tick(0.6 + LINK_GRACE_S - 0.1)
    assert not agg.state.failing  # 2 and 3 have not reported yet
    out = agg.on_tick(0.6 + LINK_GRACE_S + 0.1)
    assert [(d["replica"], d["cause"]) for d in logs(out, "failure_detected")] == [(0, "link")]
    # nobody named anyone: no fence, the reports go to the state (the same members form again)
    agg2 = make(expected=3)
    three_replicas(agg2)
    _all_waiting(agg2, 3, 0.5)
    out = []
    for r in range(3):
        out += agg2.on_message(f"r{r}_0", msg("report", id=r + 1, generation=1, suspects=[], timeout=True), 0.6)
    assert logs(out, "failure_detected") == [] and logs(out, "link_report")[0]["fenced"] == []
    assert agg2.state.failing


def test_nobody_is_judged_across_the_coordinators_own_stall() -> None:
    """The coordinator was not scheduled from 0.5 s to 3.0 s (heartbeat timeout 1 s): after reading
    what arrived, ``on_resumed`` gives every connection a fresh grace and moves the hang clocks on."""
    agg = make(expected=3)
    three_replicas(agg)
    _all_waiting(agg, 3, 0.5)
    out = agg.on_resumed(2.4, 3.0)
    assert logs(out, "coordinator_stalled") == [{"seconds": 2.4}]
    assert logs(agg.on_tick(3.0), "failure_detected") == []
    for r in (0, 1):  # replica 2 is silent from 3.0 on, the others are heard: it alone is fenced
        agg.on_heard(f"r{r}_0", 3.8)
    assert [(d["replica"], d["cause"]) for d in logs(agg.on_tick(4.1), "failure_detected")] \
        == [(2, "heartbeat_timeout")]


def test_every_member_silent_at_once_is_the_coordinators_isolation_not_their_deaths() -> None:
    """Every replica's heartbeats stop together at 0.5 s (a partition around the coordinator's host): nobody
    is fenced while the silence lasts up to the hold; the first heartbeat back ends it and every connection
    gets a fresh grace, so the replicas coming back a moment later are not fenced either. A silence beyond
    the hold is judged as before: the members themselves have given up by then."""
    agg = make(expected=3)
    three_replicas(agg)
    _heard(agg, 3, 0.5)
    out = agg.on_tick(3.0)
    assert logs(out, "failure_detected") == []
    assert logs(out, "coordinator_isolated") == [{"replicas": [0, 1, 2], "silent_s": 2.5}]
    assert logs(agg.on_tick(20.0), "failure_detected") == []
    agg.on_heard("r0_0", 20.2)
    out = agg.on_tick(20.3)
    assert logs(out, "coordinator_reached") == [{"seconds": 19.8}] and logs(out, "failure_detected") == []
    _heard(agg, 3, 20.6)
    assert logs(agg.on_tick(21.0), "failure_detected") == []
    held = make(expected=3)
    three_replicas(held)
    _heard(held, 3, 0.5)
    held.on_tick(3.0)
    assert len(logs(held.on_tick(0.5 + held.isolation_hold_s + 0.1), "failure_detected")) == 3
    alone = make(expected=1)  # one replica's silence says nothing about the coordinator: judged at once
    replica(alone, "s", 0, 1)
    alone.on_heard("s0", 0.5)
    assert len(logs(alone.on_tick(2.0), "failure_detected")) == 1


def _heard(agg: RankAggregator, n: int, now: float) -> None:
    for r in range(n):
        agg.on_heard(f"r{r}_0", now)
        agg.on_message(f"r{r}_0", msg("hb", progress=5, activity="wait", generation=1), now)


def test_a_restarted_coordinator_takes_the_least_any_rank_of_a_replica_committed() -> None:
    """Ranks of one replica that heard different commits before the crash make the whole replica behind;
    a malformed ``resume`` is refused like any malformed register."""
    agg = make()

    def back(conn: str, replica_id: int, rank: int, ranks: int, committed: int) -> list[Out]:
        agg.on_open(conn, f"peer-{conn}", 0.0)
        resume = {"generation": 3, "members": [0, 1], "committed": committed, "speeds": None}
        return agg.on_message(conn, msg("register", id=1, token=TOKEN, replica=replica_id, join=False, rank=rank,
                                        ranks=ranks, resume=resume), 0.0)

    back("a0", 0, 0, 2, 12)
    back("a1", 0, 1, 2, 11)  # rank 1's 'committed 12' was lost with the coordinator
    out = back("b0", 1, 0, 1, 12)
    assert logs(out, "rebuilt")[0]["behind"] == [0]
    m = sent(out, "membership")["a0"]["membership"]
    assert (m["generation"], m["joined"], m["resync"], m["step"]) == (4, [0], True, 13)
    agg.on_open("c0", "peer-c0", 0.0)
    out = agg.on_message("c0", msg("register", id=1, token=TOKEN, replica=2, join=False,
                                   resume={"generation": 0, "members": [], "committed": 1}), 0.0)
    assert sent(out, "error")["c0"]["code"] == "malformed" and closed(out) == ["c0"]


def test_a_rank_asking_to_stop_makes_its_replicas_vote_a_stop() -> None:
    agg = make()
    two_replicas(agg)
    agg.on_message("a0", msg("vote", id=5, generation=1, step=0, ids=IDS), 0.0)
    agg.on_message("a1", msg("vote", id=6, generation=1, step=0, ids=IDS, stop=True), 0.0)
    out = agg.on_message("b0", msg("vote", id=7, generation=1, step=0, ids=IDS), 0.0)
    assert {c: m["stop"] for c, m in sent(out, "committed").items()} == {"a0": True, "a1": True, "b0": True}


def test_every_registered_connection_gets_a_beat_each_beat_s_and_the_ok_names_it() -> None:
    st = MembershipState(expected=2, min_members=1, store_host="h", store_port=1, ack_timeout_s=1.0)
    agg = RankAggregator(st, token=TOKEN, heartbeat_timeout_s=1.0, register_timeout_s=10.0, beat_s=0.5)
    assert sent(register(agg, "a0", 0), "ok")["a0"]["beat_s"] == 0.5
    agg.on_open("x", "peer-x", 0.0)  # not registered: no beats
    assert set(sent(agg.on_tick(0.1), "beat")) == {"a0"}
    assert sent(agg.on_tick(0.5), "beat") == {}
    assert set(sent(agg.on_tick(0.7), "beat")) == {"a0"}
    assert "beat_s" not in sent(register(make(), "a0", 0), "ok")["a0"]  # an aggregator without beats names none


def test_an_operator_connection_is_no_member_never_times_out_and_its_drain_is_answered_at_the_commit() -> None:
    agg = make(expected=3, register_timeout=1.0)
    for r, name in enumerate("abc"):
        register(agg, f"{name}0", r)
    agg.on_open("op", "peer-op", 0.0)
    (status,) = sent(agg.on_message("op", msg("status", id=1, token=TOKEN), 0.1), "job_status").values()
    assert status["re"] == 1 and [r["replica"] for r in status["status"]["replicas"]] == [0, 1, 2]
    assert agg.on_message("op", msg("drain", id=2, token=TOKEN, replica=1), 0.2) == [
        Log(Event.DRAIN_REQUESTED, {"replica": 1, "step": 0, "generation": 1})]  # answered at the commit
    for conn in ("a0", "b0", "c0"):
        agg.on_heard(conn, 2.0)
    assert closed(agg.on_tick(2.5)) == []  # past the register timeout: an operator's connection stays
    refused = sent(agg.on_message("a0", msg("drain", id=5, token=TOKEN, replica=2), 2.6), "error")
    assert refused["a0"]["code"] == "not_operator" and agg.state.draining == {1}
    out = [*vote(agg, "a0", 10, now=3.0), *vote(agg, "b0", 11, now=3.0), *vote(agg, "c0", 12, now=3.0)]
    assert sent(out, "drained") == {"op": {"type": "drained", "re": 2, "replica": 1, "step": 0, "generation": 2}}
    assert sent(out, "committed")["b0"]["left"] is True and agg.state.current.members == (0, 2)
    out = agg.on_message("op", msg("status", id=3, token="nope"), 3.1)
    assert sent(out, "error")["op"]["code"] == "unauthorized" and closed(out) == ["op"]


def _four_waiting(hb: float = 60.0) -> RankAggregator:
    agg = make(expected=4, hb=hb)
    for r in range(4):
        replica(agg, f"r{r}_", r, 1)
    _all_waiting(agg, 4, 0.5)
    return agg


def test_a_partition_before_the_start_fences_one_side_of_the_cut_not_the_same_members_again() -> None:
    """Replicas 1 and 2 cannot connect: their rendezvous fails (no timeout flag on gloo's connect error,
    each names the other), 0 and 3 time out in their first collective naming nobody. Before, 0 and 3's
    reports named nobody and the same four members formed again for ever."""
    agg = _four_waiting()
    assert agg.on_message("r0_0", msg("report", id=1, generation=1, suspects=[], timeout=True), 30.0) == []
    assert agg.on_message("r1_0", msg("report", id=1, generation=1, suspects=[2]), 30.1) == []  # held: no round
    assert not agg.state.failing
    agg.on_message("r3_0", msg("report", id=1, generation=1, suspects=[], timeout=True), 30.2)
    out = agg.on_message("r2_0", msg("report", id=1, generation=1, suspects=[1]), 30.3)
    assert logs(out, "link_report")[0]["fenced"] == [2] and logs(out, "link_report")[0]["broken"] == [[1, 2]]
    assert [(d["replica"], d["cause"]) for d in logs(out, "failure_detected")] == [(2, "link")]
    for r in (0, 1, 3):
        out = agg.on_message(f"r{r}_0", msg("ack", generation=1), 30.4)
    assert logs(out, "generation")[0]["members"] == [0, 1, 3]
    assert agg.state.cuts.pairs == {(1, 2)}


def test_a_report_without_the_timeout_flag_does_not_skip_the_link_rule() -> None:
    """Mid-run: 0 timed out first; the others' pairs with it closed, so they report a backend error
    (no timeout flag). Before, such a report started a failure round at once and the held reports were
    handed back unjudged: the same members formed again."""
    agg = _four_waiting()
    agg.on_message("r3_0", msg("report", id=1, generation=1, suspects=[]), 29.9)  # first, naming nobody: held
    agg.on_message("r0_0", msg("report", id=1, generation=1, suspects=[], timeout=True), 30.0)
    assert not agg.state.failing
    agg.on_message("r2_0", msg("report", id=1, generation=1, suspects=[1]), 30.2)
    out = agg.on_message("r1_0", msg("report", id=1, generation=1, suspects=[2]), 30.3)
    assert [(d["replica"], d["cause"]) for d in logs(out, "failure_detected")] == [(2, "link")]


def test_a_member_that_never_reports_is_fenced_once_the_grace_is_over() -> None:
    agg = _four_waiting()
    for r in (0, 1, 3):
        agg.on_message(f"r{r}_0", msg("report", id=1, generation=1, suspects=[], timeout=True), 30.0)
    assert not agg.state.failing
    out = agg.on_tick(30.0 + LINK_GRACE_S + 0.1)
    assert logs(out, "link_report")[0]["silent"] == [2]
    assert [(d["replica"], d["cause"]) for d in logs(out, "failure_detected")] == [(2, "link")]


def _with_probe(agg: RankAggregator, conn: str, r: int, join: bool, now: float) -> list[Out]:
    agg.on_open(conn, "peer", now)
    return agg.on_message(conn, msg("register", id=1, token=TOKEN, replica=r, join=join, probe=f"10.0.0.{r}:7"), now)


def test_a_replica_cut_from_a_member_joins_only_once_its_probe_reaches_it() -> None:
    """After 2 was fenced for its cut with 1, 2 registers again (the launcher's --rejoin-after, or by
    hand): it is held back (``join_held``) at every commit and asked to probe 1; once it reaches 1, the
    next commit admits it."""
    agg = make(expected=2, hb=60.0)
    _with_probe(agg, "a0", 0, False, 0.0)
    _with_probe(agg, "b0", 1, False, 0.0)
    agg.state.cuts.add([(1, 2)])
    assert sent(_with_probe(agg, "c0", 2, True, 0.1), "ok")["c0"]["re"] == 1
    out = vote(agg, "a0", 11) + vote(agg, "b0", 12)
    assert sent(out, "membership") == {}  # no generation with the broken pair
    assert all(m["new_generation"] is None for m in sent(out, "committed").values())
    assert logs(out, "join_held") == [{"replica": 2, "generation": 1, "cannot_reach": [1]}]
    assert sent(agg.on_tick(1.0), "reach") == {"c0": {"type": "reach", "peers": {"1": "10.0.0.1:7"}}}
    assert agg.on_message("c0", msg("reached", reached=[]), 1.1) == []  # still cut
    out = agg.on_message("c0", msg("reached", reached=[0, 1]), 1.2)
    assert logs(out, "link_restored") == [{"pairs": [[1, 2]], "generation": 1}]
    out = vote(agg, "a0", 13, step=1) + vote(agg, "b0", 14, step=1)
    assert logs(out, "generation")[0]["members"] == [0, 1, 2]


def test_members_stuck_in_a_rendezvous_are_asked_whom_they_reach_and_the_rule_hears_them() -> None:
    """Replicas 1 and 2 hang in a rendezvous that cannot connect (their own timeout comes later); 0 and 3
    time out naming nobody. The coordinator asks every member to probe its peers at once: 1 and 2 each
    answer without the other, and 2 is fenced long before the grace (before: both silent, nobody named)."""
    agg = make(expected=4, hb=60.0)
    for r in range(4):
        _with_probe(agg, f"r{r}_0", r, False, 0.0)
    _all_waiting(agg, 4, 0.5)
    out = agg.on_message("r0_0", msg("report", id=1, generation=1, suspects=[], timeout=True), 30.0)
    asked = sent(out, "reach")
    assert set(asked) == {"r0_0", "r1_0", "r2_0", "r3_0"}
    assert asked["r1_0"]["peers"] == {"0": "10.0.0.0:7", "2": "10.0.0.2:7", "3": "10.0.0.3:7"}
    agg.on_message("r3_0", msg("report", id=1, generation=1, suspects=[], timeout=True), 30.1)
    agg.on_message("r1_0", msg("reached", reached=[0, 3]), 30.5)
    out = agg.on_message("r2_0", msg("reached", reached=[0, 3]), 30.6)
    report = logs(out, "link_report")[0]
    assert (report["broken"], report["silent"], report["fenced"]) == ([[1, 2]], [], [2])
    assert {c: m["re"] for c, m in sent(out, "ok").items()} == {"r0_0": 1, "r3_0": 1}


def test_a_process_its_launcher_saw_die_is_a_dead_replica_before_its_connection_closes() -> None:
    agg = make()
    register(agg, "a0", 0, 0, 2, pid=100)
    register(agg, "a1", 0, 1, 2, pid=101)
    out = register(agg, "b0", 1, pid=200)
    assert set(sent(out, "membership")) == {"a0", "a1", "b0"}
    agg.on_open("op", "peer-op", 1.0)  # the launcher's watch: rank 1's process died, its connection still open
    out = agg.on_message("op", msg("died", id=5, token=TOKEN, pid=101), 1.0)
    assert sent(out, "ok") == {"op": {"type": "ok", "re": 5}}
    assert logs(out, "failure_detected") == [{"replica": 0, "cause": "process_died", "generation": 1}]
    assert set(closed(out)) == {"a0", "a1"} and set(sent(out, "failing")) == {"b0"}
    assert agg.on_closed("a1", "connection_closed", 1.03) == []  # its connection closing then: nothing more
    # a PID no member registered with (a process already replaced, another host's) changes nothing
    agg.on_open("op2", "peer-op2", 1.1)
    out = agg.on_message("op2", msg("died", id=6, token=TOKEN, pid=101), 1.1)
    assert sent(out, "ok") == {"op2": {"type": "ok", "re": 6}} and not logs(out, "failure_detected")
    agg.on_open("op3", "peer-op3", 1.2)
    out = agg.on_message("op3", msg("died", id=7, token="wrong", pid=200), 1.2)
    assert not logs(out, "failure_detected") and agg.snapshot()["live"] == [1]
