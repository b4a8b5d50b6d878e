"""One connection per replica (a relay) in the coordinator's rank aggregation, driven directly (pure, ms).

Connection ``"R"`` is the relay of replica 0 (3 ranks); ``"b0"`` is replica 1 of one rank on its
own connection.
"""

from __future__ import annotations

from typing import Any

from test_coord_ranks_logic import TOKEN, closed, logs, msg, register, sent

from recover.coord.protocol import CLIENT_TYPES, FrameDecoder, ProtocolError, batch_beats, batch_message, encode
from recover.coord.ranks import Out, RankAggregator
from recover.coord.state import MembershipState

P = 3


def make(hb: float = 1.0, heartbeat_s: float | None = None, scan_s: float = 0.0) -> RankAggregator:
    st = MembershipState(expected=2, min_members=1, store_host="h", store_port=1, ack_timeout_s=hb)
    return RankAggregator(st, token=TOKEN, heartbeat_timeout_s=hb, register_timeout_s=10.0,
                          heartbeat_s=heartbeat_s, scan_s=scan_s)


def relay(agg: RankAggregator, conn: str = "R", replica: int = 0, ranks: int = P, now: float = 0.0,
          rid: int = 1) -> list[Out]:
    agg.on_open(conn, f"peer-{conn}", now)
    return agg.on_message(conn, {"type": "register", "id": rid, "token": TOKEN, "replica": replica, "join": False,
                                 "ranks": ranks, "relay": True}, now)


def beats(ranks: list[int], progress: int = 1, activity: str = "c", generation: int = 1) -> dict[str, Any]:
    return msg("hbs", ranks=ranks, progress=[progress] * len(ranks), activity=activity * len(ranks),
               generation=[generation] * len(ranks))


def formed(agg: RankAggregator) -> None:
    relay(agg)
    out = register(agg, "b0", 1)
    assert set(sent(out, "membership")) == {"R", "b0"}  # one push per connection, not one per rank


def test_a_relay_registers_all_its_ranks_at_once_and_gets_one_reply_with_the_interval() -> None:
    agg = make(heartbeat_s=0.5)
    out = relay(agg, rid=7)
    assert sent(out, "ok") == {"R": {"type": "ok", "re": 7, "generation": 0, "heartbeat_s": 0.5}}
    assert agg.slots[0].registered and sorted(agg.slots[0].links) == [0, 1, 2]
    out = register(agg, "b0", 1)
    assert sent(out, "membership")["R"]["membership"]["members"] == [0, 1]


def test_a_relay_cannot_join_ranks_registered_on_their_own_nor_name_a_rank() -> None:
    agg = make()
    register(agg, "x1", 0, rank=1, ranks=P)
    out = relay(agg)
    assert sent(out, "error")["R"]["code"] == "rank_mismatch" and closed(out) == ["R"]
    agg.on_open("Q", "peer-Q", 0.0)
    out = agg.on_message("Q", {"type": "register", "id": 1, "token": TOKEN, "replica": 2, "join": False,
                               "ranks": 2, "rank": 0, "relay": True}, 0.0)
    assert sent(out, "error")["Q"]["code"] == "bad_rank"


def test_failing_is_acked_for_the_replica_once_every_rank_acked() -> None:
    agg = make()
    formed(agg)
    out = agg.on_closed("b0", "connection_closed", 0.1)
    assert set(sent(out, "failing")) == {"R"}
    agg.on_message("R", msg("ack", generation=1, rank=0), 0.1)
    assert agg.state.failing  # ranks 1 and 2 still owe their ack
    out = agg.on_message("R", msg("ack", generation=1, rank=1), 0.1)
    out = agg.on_message("R", msg("ack", generation=1, rank=2), 0.1)
    assert sent(out, "membership")["R"]["membership"]["members"] == [0]


def test_one_ack_without_a_rank_speaks_for_every_rank() -> None:
    agg = make()
    formed(agg)
    agg.on_closed("b0", "connection_closed", 0.1)
    out = agg.on_message("R", msg("ack", generation=1), 0.1)
    assert sent(out, "membership")["R"]["membership"]["generation"] == 2


def test_rank_votes_count_once_all_ranks_voted_and_the_reply_goes_once_per_request() -> None:
    agg = make()
    formed(agg)
    vote = {"generation": 1, "step": 0, "ids": [0, 1]}
    for k in range(P):
        agg.on_message("R", msg("vote", id=10 + k, rank=k, **vote), 0.2)
    assert agg.state.votes and 0 in agg.state.votes
    out = agg.on_message("b0", msg("vote", id=5, **vote), 0.2)
    got = [a.msg["re"] for a in out if getattr(a, "conn", None) == "R" and a.msg["type"] == "committed"]
    assert sorted(got) == [10, 11, 12]


def test_one_vote_without_a_rank_is_the_whole_replica_and_gets_one_reply() -> None:
    agg = make()
    formed(agg)
    vote = {"generation": 1, "step": 0, "ids": [0, 1]}
    agg.on_message("R", msg("vote", id=9, **vote), 0.2)
    out = agg.on_message("b0", msg("vote", id=5, **vote), 0.2)
    assert sent(out, "committed")["R"]["re"] == 9 and agg.state.committed_step == 0


def test_ranks_of_a_relay_that_vote_differently_fence_the_replica() -> None:
    agg = make()
    formed(agg)
    agg.on_message("R", msg("vote", id=1, rank=0, generation=1, step=0, ids=[0, 1]), 0.2)
    out = agg.on_message("R", msg("vote", id=2, rank=1, generation=1, step=0, ids=[0]), 0.2)
    assert logs(out, "rank_vote_disagreement") and 0 not in agg.state.live


def test_a_silent_rank_in_the_batched_heartbeats_fences_the_replica() -> None:
    agg = make(hb=1.0)
    formed(agg)
    for t in (0.5, 1.0, 1.5):
        agg.on_message("R", beats([0, 1]), t)  # rank 2 is never in the batch
        agg.on_heard("b0", t)
        agg.on_heard("R", t)  # bytes on the relay prove only the relay alive
        out = agg.on_tick(t)
        if t < 1.01:
            assert closed(out) == []
    assert closed(out) == ["R"] and 0 not in agg.state.live
    assert sent(out, "error")["R"]["code"] == "fenced"


def test_batched_heartbeats_keep_every_rank_alive_and_carry_progress() -> None:
    agg = make(hb=1.0)
    formed(agg)
    for i, t in enumerate((0.5, 1.0, 1.5, 2.0, 2.5)):
        agg.on_message("R", beats([0, 1, 2], progress=i, activity="w"), t)
        agg.on_heard("b0", t)
        assert closed(agg.on_tick(t)) == []
    assert agg.liveness.waiting() == {0}


def test_hbs_is_refused_on_a_rank_connection_and_hb_on_a_relay() -> None:
    agg = make()
    formed(agg)
    out = agg.on_message("b0", beats([0]), 0.1)
    assert sent(out, "error")["b0"]["code"] == "not_relay" and closed(out) == []
    out = agg.on_message("R", msg("hb", progress=1, activity="compute"), 0.1)
    assert sent(out, "error")["R"]["code"] == "not_batched"
    out = agg.on_message("R", msg("ack", generation=1, rank=P), 0.1)
    assert sent(out, "error")["R"]["code"] == "bad_rank"


def test_the_relay_closing_kills_the_replica_once() -> None:
    agg = make()
    formed(agg)
    out = agg.on_closed("R", "connection_closed", 0.3)
    assert logs(out, "failure_detected") == [{"replica": 0, "cause": "connection_closed", "generation": 1}]
    assert set(sent(out, "failing")) == {"b0"}


def test_timeouts_are_judged_on_the_scan_clock() -> None:
    agg = make(hb=1.0, scan_s=0.5)
    formed(agg)
    agg.on_message("R", beats([0, 1, 2]), 0.0)
    assert closed(agg.on_tick(0.9)) == []  # a scan at 0.9: nobody silent yet
    agg.on_heard("b0", 1.1)  # b0 is heard (were every member silent, the coordinator would be the cut-off one)
    assert closed(agg.on_tick(1.2)) == []  # R silent since 1.2 s, but the next scan is at 1.4
    assert set(closed(agg.on_tick(1.4))) == {"R"}


def test_batch_beats_checks_lengths_and_letters() -> None:
    assert batch_beats(beats([0, 1], progress=3, activity="i"), P) == [(0, 3, "io", 1), (1, 3, "io", 1)]
    for bad in (msg("hbs", ranks=[0], progress=[], activity="c", generation=[1]),
                msg("hbs", ranks=[0], progress=[1], activity="x", generation=[1]),
                msg("hbs", ranks=[0, 1], progress=[1, 1], activity="cc", generation=[1]),
                msg("hbs", progress=[1, 1], activity="cc", generation=1)):  # every rank is P = 3 of them
        try:
            batch_beats(bad, P)
        except ProtocolError as exc:
            assert exc.code == "malformed"
        else:
            raise AssertionError(f"{bad} was accepted")


def test_a_batch_of_every_rank_leaves_out_the_ranks_and_a_common_generation() -> None:
    """What a relay writes (wire protocol 2): the usual batch names no ranks and one generation; any other
    keeps its lists. Both read back as the same entries."""
    every = batch_message([0, 1, 2], [4, 4, 5], "cwi", [2, 2, 2], P)
    assert every == {"type": "hbs", "progress": [4, 4, 5], "activity": "cwi", "generation": 2}
    some = batch_message([0, 2], [4, 5], "ci", [2, 1], P)
    assert some == {"type": "hbs", "ranks": [0, 2], "progress": [4, 5], "activity": "ci", "generation": [2, 1]}
    assert batch_beats(every, P) == [(0, 4, "compute", 2), (1, 4, "wait", 2), (2, 5, "io", 2)]
    assert batch_beats(some, P) == [(0, 4, "compute", 2), (2, 5, "io", 1)]
    for m in (every, some):
        (item,) = FrameDecoder(CLIENT_TYPES).feed(encode(m))
        assert not isinstance(item, ProtocolError) and batch_beats(item, P) == batch_beats(m, P)
    for bad in ({**every, "generation": True}, {**every, "generation": [1, "x", 2]}, {**every, "ranks": None}):
        (item,) = FrameDecoder(CLIENT_TYPES).feed(encode(bad))
        assert isinstance(item, ProtocolError) and item.code == "malformed", bad


def test_a_batch_of_every_rank_keeps_each_rank_alive_and_a_short_one_is_refused() -> None:
    agg = make(hb=1.0)
    formed(agg)
    for i, t in enumerate((0.5, 1.0, 1.5, 2.0, 2.5)):
        out = agg.on_message("R", batch_message([0, 1, 2], [i] * P, "w" * P, [1] * P, P), t)
        agg.on_heard("b0", t)
        assert closed(out) == [] and closed(agg.on_tick(t)) == []
    assert agg.liveness.waiting() == {0} and agg.liveness.activities(0) == ("wait",) * P
    out = agg.on_message("R", msg("hbs", progress=[9, 9], activity="cc", generation=1), 2.6)
    assert sent(out, "error")["R"]["code"] == "malformed" and closed(out) == []
    assert agg.liveness.activities(0) == ("wait",) * P  # a refused batch changes nothing
