"""The coordinator's membership state machine, driven directly (pure, milliseconds)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from recover.coord.actions import Fence, Log, Refused, Send
from recover.coord.protocol import Ballot, Resume
from recover.coord.state import MembershipState


def make(n: int = 3, ack_timeout: float = 1.0) -> MembershipState:
    st = MembershipState(expected=n, min_members=2, store_host="h", store_port=1, ack_timeout_s=ack_timeout,
                         max_replicas=8)
    for r in range(n):
        st.on_register(r, False, 1, 0.0)
    return st


def vote(st: MembershipState, replica: int, rid: int, g: int, step: int, ids: list[int], now: float,
         mb_s: float | None = None, **extra: Any) -> list:
    """``replica``'s vote as a ballot (its ``extra``: stop, fp, audit, leave)."""
    return st.on_vote(replica, rid, Ballot.make(g, step, ids, mb_s, **extra), now)


def sent(acts: list, kind: str) -> dict[int, dict]:
    return {a.replica: a.msg for a in acts if isinstance(a, Send) and a.msg["type"] == kind}


def logs(acts: list, kind: str) -> list[dict]:
    return [a.fields for a in acts if isinstance(a, Log) and a.kind == kind]


def test_a_replica_id_outside_max_replicas_is_refused_and_the_job_goes_on() -> None:
    st = MembershipState(expected=2, min_members=1, store_host="h", store_port=1, ack_timeout_s=1, max_replicas=3)
    st.on_register(0, False, 1, 0.0)
    st.on_register(1, False, 1, 0.0)
    before = st.summary()
    for bad in (3, 99, -1):
        with pytest.raises(Refused, match=r"bad_replica: replica id -?\d+ is outside this job's 0\.\.2"):
            st.on_register(bad, True, 1, 0.1)
    assert st.summary() == before
    st.on_register(2, True, 1, 0.1)  # within the bound: a joiner
    assert st.summary()["pending_join"] == [2]
    with pytest.raises(ValueError, match="max_replicas"):
        MembershipState(expected=2, min_members=1, store_host="h", store_port=1, ack_timeout_s=1, max_replicas=1)


def test_every_generation_has_a_fresh_secret_sent_to_its_members_and_never_logged() -> None:
    st = make(3)
    first = sent(st.on_register(3, True, 1, 0.0), "membership")  # nothing yet: a joiner waits for a commit
    acts = [*vote(st, 0, 10, 1, 0, [0], 0.1), *vote(st, 1, 11, 1, 0, [0], 0.1), *vote(st, 2, 12, 1, 0, [0], 0.1)]
    pushed = sent(acts, "membership")
    assert not first and sorted(pushed) == [0, 1, 2, 3]
    secrets_ = {m["membership"]["secret"] for m in pushed.values()}
    assert len(secrets_) == 1
    (secret,) = secrets_
    assert len(secret) == 32 and int(secret, 16) >= 0  # 128 random bits, hex
    acts += st.on_dead(3, "connection_closed", 0.2) + st.on_tick(5.0)
    assert st.current.generation == 3 and st.current.secret not in (secret, "")
    assert not any(secret in repr(a.fields) or st.current.secret in repr(a.fields) for a in acts if isinstance(a, Log))


def test_initial_generation_forms_when_expected_replicas_registered() -> None:
    st = MembershipState(expected=2, min_members=1, store_host="h", store_port=1, ack_timeout_s=1)
    assert st.on_register(1, False, 1, 0.0)[0].msg["type"] == "ok"
    assert st.current is None
    acts = st.on_register(0, False, 1, 0.0)
    assert st.current is not None and st.current.members == (0, 1) and st.current.generation == 1
    assert set(sent(acts, "membership")) == {0, 1}
    with pytest.raises(Refused, match="duplicate_replica"):
        st.on_register(0, False, 2, 0.0)


def test_death_runs_a_failure_round_and_names_exactly_the_dead() -> None:
    st = make(4)
    acts = st.on_dead(3, "connection_closed", 1.0)
    assert set(sent(acts, "failing")) == {0, 1, 2}
    acts = st.on_dead(1, "connection_closed", 1.001)  # a second death inside the round
    assert set(sent(acts, "failing")) == set()  # one round, one notice
    st.on_ack(0, 1, 1.002)
    acts = st.on_ack(2, 1, 1.003)
    assert st.current.generation == 2 and st.current.members == (0, 2) and st.current.dead == (1, 3)
    assert set(sent(acts, "membership")) == {0, 2}
    assert logs(acts, "quorum_lost") == []


def test_member_that_never_acks_is_fenced_at_the_deadline() -> None:
    st = make(3, ack_timeout=0.5)
    st.on_dead(2, "connection_closed", 0.0)
    st.on_ack(0, 1, 0.01)
    assert st.on_tick(0.3) == [] and st.current.generation == 1
    acts = st.on_tick(0.6)
    assert [a.replica for a in acts if isinstance(a, Fence)] == [1]
    assert st.current.members == (0,) and logs(acts, "quorum_lost")


def test_report_without_death_rebuilds_with_everyone() -> None:
    st = make(3)
    acts = st.on_report(1, 7, 1, [2], 0.0)
    assert sent(acts, "ok")[1]["re"] == 7 and set(sent(acts, "failing")) == {0, 1, 2}
    for r in range(3):
        st.on_ack(r, 1, 0.01)
    assert st.current.generation == 2 and st.current.members == (0, 1, 2) and st.current.dead == ()
    # a late report about the old generation is acknowledged, not acted on
    assert st.on_report(0, 8, 1, [], 0.02)[0].fields["superseded"] is True
    assert st.current.generation == 2
    with pytest.raises(Refused, match="bad_generation"):
        st.on_report(0, 9, 5, [], 0.03)


def test_commit_needs_every_member_and_identical_ids() -> None:
    st = make(3)
    assert vote(st, 0, 1, 1, 0, [0, 1, 2, 3], 0.0) == []
    assert vote(st, 1, 1, 1, 0, [3, 2, 1, 0], 0.0) == []  # order does not matter
    acts = vote(st, 2, 1, 1, 0, [0, 1, 2, 3], 0.0)
    assert set(sent(acts, "committed")) == {0, 1, 2} and st.committed_step == 0
    assert all(m["new_generation"] is None for m in sent(acts, "committed").values())
    with pytest.raises(Refused, match="stale_step"):
        vote(st, 0, 2, 1, 0, [0], 0.0)
    with pytest.raises(Refused, match="stale_generation"):
        vote(st, 0, 2, 0, 1, [0], 0.0)
    vote(st, 0, 3, 1, 1, [0, 1], 0.0)
    vote(st, 1, 3, 1, 1, [0, 1], 0.0)
    acts = vote(st, 2, 3, 1, 1, [0], 0.0)  # disagreement: nobody commits, generation is rebuilt
    assert set(sent(acts, "aborted")) == {0, 1, 2} and st.committed_step == 0
    assert set(sent(acts, "failing")) == {0, 1, 2}


def test_death_during_vote_aborts_pending_votes() -> None:
    st = make(3)
    vote(st, 0, 5, 1, 0, [0, 1], 0.0)
    st.on_dead(2, "heartbeat_timeout", 0.1)
    st.on_ack(1, 1, 0.1)
    acts = st.on_ack(0, 1, 0.1)
    assert sent(acts, "aborted")[0]["re"] == 5 and st.committed_step == -1
    assert st.current.members == (0, 1)


def test_joiner_is_admitted_only_at_a_commit() -> None:
    st = make(2)
    st.on_dead(1, "connection_closed", 0.0)
    st.on_ack(0, 1, 0.0)
    assert st.current.members == (0,)
    acts = st.on_register(1, True, 1, 0.1)
    assert logs(acts, "join_request") and st.current.members == (0,)
    acts = vote(st, 0, 2, 2, 0, [0, 1], 0.2)
    assert st.current.generation == 3 and st.current.members == (0, 1) and st.current.joined == (1,)
    assert st.current.step == 1
    assert sent(acts, "committed")[0]["new_generation"] == 3
    assert set(sent(acts, "membership")) == {0, 1}
    kinds = [a.msg["type"] for a in acts if isinstance(a, Send) and a.replica == 0]
    assert kinds.index("membership") < kinds.index("committed")  # the client knows it before the reply


def test_joined_is_carried_until_the_next_commit() -> None:
    st = make(3)
    st.on_dead(2, "connection_closed", 0.0)
    st.on_ack(0, 1, 0.0)
    st.on_ack(1, 1, 0.0)
    st.on_register(2, True, 1, 0.1)
    vote(st, 0, 2, 2, 0, [0], 0.2)
    vote(st, 1, 2, 2, 0, [0], 0.2)
    assert st.current.generation == 3 and st.current.joined == (2,)
    st.on_dead(1, "connection_closed", 0.3)  # dies before the state transfer completed
    st.on_ack(0, 3, 0.3)
    st.on_ack(2, 3, 0.3)
    assert st.current.generation == 4 and st.current.members == (0, 2) and st.current.joined == (2,)
    vote(st, 0, 3, 4, 1, [0], 0.4)
    vote(st, 2, 3, 4, 1, [0], 0.4)  # the first commit with the joiner: it has the state now
    st.on_dead(0, "connection_closed", 0.5)
    st.on_ack(2, 4, 0.5)
    assert st.current.members == (2,) and st.current.joined == ()


def test_joiner_with_nobody_left_is_admitted_at_once() -> None:
    st = make(1)
    st.on_dead(0, "connection_closed", 0.0)
    assert st.current.members == ()
    st.on_register(5, True, 1, 0.1)
    assert st.current.members == (5,) and st.current.joined == (5,)


def test_with_nobody_holding_the_state_the_members_restore_a_checkpoint_and_may_commit_an_older_step() -> None:
    """Every member died after step 5 was committed (a joiner waiting at the time never got the state): the
    generation of the joiners is a ``restore`` one, and its first commit goes back to the checkpoint's step;
    the generation after it, formed by a failure before that commit, restores again; after it, nothing does."""
    st = make(2)
    for step in range(6):
        vote(st, 0, 10 + step, 1, step, [0], 0.1)
        vote(st, 1, 10 + step, 1, step, [0], 0.1)
    assert st.committed_step == 5 and not st.current.restore
    st.on_dead(0, "connection_closed", 1.0)
    st.on_dead(1, "connection_closed", 1.0)
    assert st.current.members == ()
    st.on_register(0, True, 1, 2.0)
    assert st.current.members == (0,) and st.current.restore and not st.current.resync
    st.on_register(1, True, 1, 2.1)  # waits for the next commit, as any joiner
    st.on_dead(0, "connection_closed", 2.2)  # the restore's only member dies before its first commit
    assert st.current.members == (1,) and st.current.restore  # the waiting joiner restores instead
    st.on_register(0, True, 2, 2.3)
    g = st.current.generation
    acts = vote(st, 1, 3, g, 3, [0], 2.4)  # step 3: the checkpoint holds steps 0-2
    assert sent(acts, "committed") and st.committed_step == 3
    assert st.current.members == (0, 1) and st.current.joined == (0,) and not st.current.restore
    with pytest.raises(Refused):  # an older step is stale again
        vote(st, 1, 4, st.current.generation, 2, [0], 2.6)


def test_a_joiner_after_every_member_finished_is_told_the_job_is_over() -> None:
    """A replica restarted late (--rejoin-after) registers after the others trained to the end and left:
    it must not form a generation of its own (it would wait for state nobody can send)."""
    st = make(2)
    st.on_dead(0, "left", 1.0)
    st.on_dead(1, "left", 1.1)
    acts = st.on_register(0, True, 1, 1.2)
    assert st.current.members == () and logs(acts, "join_refused") == [{"replica": 0, "reason": "finished"}]
    assert sent(acts, "error")[0]["code"] == "finished"  # the worker exits with 0: a Job's pod completes


def test_commits_carry_the_agreed_speeds_to_every_member_and_joiner() -> None:
    """Measured seconds per microbatch in the votes; the committed replies and later memberships carry
    the planned times (relative), a straggler is logged once, a dead replica's time is dropped."""
    st = make(3)
    M = list(range(12))
    every: list = []
    for step in range(4):
        acts = []
        for r, mb_s in ((0, 0.1), (1, 0.1), (2, 0.4)):
            acts += vote(st, r, 10 + step, 1, step, M, 0.0, mb_s)
        every += acts
        replies = sent(acts, "committed")
        assert len({str(m["speeds"]) for m in replies.values()}) == 1  # one plan for all
        if step < 2:
            assert replies[0]["speeds"] is None  # fewer than 3 samples: the even split stands
    assert replies[0]["speeds"] == {"0": 1.0, "1": 1.0, "2": 4.0}
    assert [(f["replica"], f["slowdown"]) for f in logs(every, "straggler")] == [(2, 4.0)]
    assert len(logs(every, "rebalanced")) == 1
    st.on_register(3, True, 1, 0.0)
    acts = vote(st, 0, 20, 1, 4, M, 0.0, 0.1) + vote(st, 1, 20, 1, 4, M, 0.0, 0.1) + \
        vote(st, 2, 20, 1, 4, M, 0.0, 0.4)
    joined = sent(acts, "membership")[3]["membership"]
    assert joined["speeds"] == {"0": 1.0, "1": 1.0, "2": 4.0} == sent(acts, "committed")[0]["speeds"]
    st.on_dead(2, "closed", 0.0)
    assert 2 not in (st.speeds.planned or {}) and not st.speeds.stragglers


# ---- graceful stop ---------------------------------------------------------------------------------

def test_a_vote_asking_to_stop_makes_that_commit_a_stop_for_every_member() -> None:
    st = make(3)
    st.on_register(7, True, 1, 0.0)  # a joiner waiting for the next commit
    vote(st, 0, 10, 1, 0, [0, 1], 0.1)
    vote(st, 1, 11, 1, 0, [0, 1], 0.1, stop=True)  # its process got SIGINT
    acts = vote(st, 2, 12, 1, 0, [0, 1], 0.1)
    assert {r: m["stop"] for r, m in sent(acts, "committed").items()} == {0: True, 1: True, 2: True}
    assert all(m["new_generation"] is None for m in sent(acts, "committed").values())  # nobody admitted
    assert sent(acts, "error")[7]["code"] == "stopping"  # the joiner is told
    assert logs(acts, "stop") == [{"step": 0, "members": [0, 1, 2], "waiting_joiners": [7]}]
    with pytest.raises(Refused, match="stopping"):
        st.on_register(6, True, 1, 0.2)


def test_the_coordinators_own_stop_request_applies_at_the_next_commit_only() -> None:
    st = make(2)
    vote(st, 0, 10, 1, 0, [0], 0.1)
    assert logs(st.request_stop(), "stop_requested") and st.request_stop() == []  # once
    acts = vote(st, 1, 11, 1, 0, [0], 0.1)
    assert all(m["stop"] for m in sent(acts, "committed").values()) and st.stopped


# ---- graceful leave ----------------------------------------------------------------------------------

def test_a_vote_asking_to_leave_forms_the_next_generation_without_it_at_that_commit() -> None:
    st = make(4)
    st.on_register(7, True, 1, 0.0)  # a joiner waiting for the next commit: admitted in the same generation
    acts = []
    for r in range(4):
        acts += vote(st, r, 10 + r, 1, 0, [0, 1, 2, 3], 0.1, leave=r == 2)  # replica 2 got SIGTERM
    committed = sent(acts, "committed")
    assert committed[2]["left"] is True and committed[2]["new_generation"] is None
    assert {r: (m["new_generation"], "left" in m) for r, m in committed.items() if r != 2} == {
        0: (2, False), 1: (2, False), 3: (2, False)}
    assert not any(m["stop"] for m in committed.values()) and not st.stopped
    assert logs(acts, "leave") == [{"replicas": [2], "step": 0, "generation": 1}]
    assert logs(acts, "failing") == [] and sent(acts, "failing") == {}  # no failure round
    (gen,) = logs(acts, "generation")
    assert (gen["reason"], gen["members"], gen["dead"], gen["joined"], gen["step"]) == (
        "leave", [0, 1, 3, 7], [2], [7], 1)
    assert sorted(sent(acts, "membership")) == [0, 1, 3, 7]  # not to the leaver
    acts = st.on_dead(2, "left", 0.2)  # its goodbye: no failure, nothing to recompute
    assert logs(acts, "left") == [{"replica": 2, "generation": 2}]
    assert logs(acts, "failure_detected") == [] and logs(acts, "failing") == [] and not st.failing
    acts = []
    for r in (0, 1, 3, 7):
        acts += vote(st, r, 20 + r, 2, 1, [0, 1, 2, 3], 0.3)
    assert logs(acts, "commit") == [{"generation": 2, "step": 1, "ids": 4}] and st.generation == 2


def test_a_stop_outranks_a_leave_and_a_leave_of_every_member_is_a_stop() -> None:
    st = make(2)
    vote(st, 0, 10, 1, 0, [0], 0.1, leave=True)
    st.request_stop()  # the launcher's graceful stop reached the coordinator meanwhile
    acts = vote(st, 1, 11, 1, 0, [0], 0.1)
    assert {r: (m["stop"], "left" in m) for r, m in sent(acts, "committed").items()} == {
        0: (True, False), 1: (True, False)}
    assert logs(acts, "generation") == [] and st.stopped
    st = make(2)
    vote(st, 0, 10, 1, 0, [0], 0.1, leave=True)
    acts = vote(st, 1, 11, 1, 0, [0], 0.1, leave=True)  # nobody would be left to hold the state: saved
    assert all(m["stop"] and "left" not in m for m in sent(acts, "committed").values()) and st.stopped
    assert logs(acts, "stop_requested") == [{"source": "leave", "step": 0}]


def test_a_drain_is_refused_with_its_reason_and_leaves_the_state_unchanged() -> None:
    st = make(3)  # min_members 2, max_replicas 8
    st.on_register(5, True, 1, 0.0)  # registered, not yet admitted
    before = (st.summary(), set(st.draining))
    for replica, code, words in ((9, "bad_replica", "0..7"), (5, "not_member", "members [0, 1, 2]"),
                                 (6, "not_member", "nothing to drain")):
        with pytest.raises(Refused, match=rf"{code}: .*{re.escape(words)}"):
            st.request_drain(replica)
    assert logs(st.request_drain(1), "drain_requested") == [{"replica": 1, "step": 0, "generation": 1}]
    assert st.request_drain(1) == []  # asked again: the same drain
    with pytest.raises(Refused, match=r"below_quorum: draining replica 2 would leave 1 member\(s\), below "
                                      r"min_replicas 2; to stop the whole job instead .*SIGTERM to the launcher"):
        st.request_drain(2)
    st.request_stop()
    with pytest.raises(Refused, match="stopping"):
        st.request_drain(0)
    assert before[0] == st.summary() and st.draining == {1}


def test_a_drained_member_leaves_at_the_next_commit_as_a_leave_does() -> None:
    st = make(4)
    st.request_drain(1)
    acts = []
    for r in range(4):
        acts += vote(st, r, 10 + r, 1, 0, [0, 1, 2, 3], 0.1)  # an ordinary vote: the drain is the coordinator's
    committed = sent(acts, "committed")
    assert committed[1]["left"] is True and committed[1]["new_generation"] is None and not committed[1]["stop"]
    assert {r: m["new_generation"] for r, m in committed.items() if r != 1} == {0: 2, 2: 2, 3: 2}
    assert logs(acts, "drained") == [{"replicas": [1], "step": 0, "generation": 1}] and logs(acts, "leave") == []
    assert logs(acts, "failing") == [] and sent(acts, "failing") == {}
    (gen,) = logs(acts, "generation")
    assert (gen["reason"], gen["members"], gen["dead"]) == ("drain", [0, 2, 3], [1])
    assert st.drained == {1: (0, 2)} and st.draining == set()
    assert logs(st.on_dead(1, "left", 0.2), "failure_detected") == [] and st.left == {1}
    st.request_drain(2)  # a drained replica that dies first is only lost: its drain is dropped
    st.on_dead(2, "connection_closed", 0.3)
    assert st.draining == set() and 2 not in st.drained and st.lost == {2}


def test_the_status_snapshot_names_every_replica_state_speed_and_fault() -> None:
    from recover.coord.operator import job_status

    st = make(4)
    for step in range(3):  # a speed is measured once a replica has 3 samples
        for r in range(4):
            vote(st, r, 10 + r, 1, step, [0, 1, 2, 3], 0.1, mb_s=0.5)
    st.request_drain(1)
    st.on_register(5, True, 1, 0.2)  # joining
    st.on_dead(3, "hung", 0.3)  # lost (a failure round opens)
    snap = job_status(st, {0: ("compute",), 1: ("wait",), 2: ("wait", "wait")}, [6], now=1.3)
    assert (snap["generation"], snap["members"], snap["committed_steps"], snap["failing"]) == (1, [0, 1, 2, 3], 3,
                                                                                               True)
    states = {row["replica"]: row["state"] for row in snap["replicas"]}
    assert states == {0: "computing", 1: "draining", 2: "waiting", 3: "lost", 5: "joining", 6: "joining"}
    assert [f for f in snap["faults"]] == [{"kind": "failure_detected", "replica": 3, "cause": "hung",
                                            "generation": 1, "step": 3, "ago_s": 1.0}]
    assert snap["goodput"] is None and all(row["planned"] is None for row in snap["replicas"])  # an even split
    assert {row["replica"]: row["mb_s"] for row in snap["replicas"]} == {0: 0.5, 1: 0.5, 2: 0.5, 3: None, 5: None,
                                                                         6: None}


def test_a_leave_below_min_members_loses_the_quorum_at_that_commit() -> None:
    st = make(2)  # min_members 2
    vote(st, 0, 10, 1, 0, [0], 0.1)
    acts = vote(st, 1, 11, 1, 0, [0], 0.1, leave=True)  # the step commits; 0 alone is too few to go on
    assert sent(acts, "committed")[1]["left"] is True and not st.stopped
    (gen,) = logs(acts, "generation")
    assert (gen["reason"], gen["members"], gen["dead"]) == ("leave", [0], [1])
    assert logs(acts, "quorum_lost") == [{"generation": 2, "members": [0], "min_members": 2}]


# ---- a restarted coordinator rebuilds the job from what the replicas hold -----------------------------

def fresh(expected: int = 3, window: float = 3.0) -> MembershipState:
    return MembershipState(expected=expected, min_members=1, store_host="h", store_port=1, ack_timeout_s=1.0,
                           rebuild_window_s=window, max_replicas=8)


def test_restart_with_every_member_back_forms_the_next_generation_without_resync() -> None:
    st = fresh()
    held = Resume(5, (0, 1, 2), 41, {0: 1.0, 1: 1.0, 2: 2.0})
    assert st.on_register(2, False, 1, 0.0, held) and st.current is None
    st.on_register(0, False, 1, 0.1, held)
    acts = st.on_register(1, False, 1, 0.2, held)
    m = st.current
    assert (m.generation, m.members, m.step, m.joined, m.resync) == (6, (0, 1, 2), 42, (), False)
    assert m.speeds == {0: 1.0, 1: 1.0, 2: 2.0} and set(sent(acts, "membership")) == {0, 1, 2}
    assert logs(acts, "rebuilt")[0]["missing"] == []
    acts = [a for r in (0, 1, 2) for a in vote(st, r, 9, 6, 42, [0], 0.3)]  # the job goes on
    assert st.committed_step == 42 and len(sent(acts, "committed")) == 3


def test_restart_after_a_half_sent_commit_resyncs_the_members_that_missed_it() -> None:
    st = fresh()
    st.on_register(0, False, 1, 0.0, Resume(2, (0, 1, 2), 9, None))  # its 'committed 10' never arrived
    st.on_register(1, False, 1, 0.0, Resume(2, (0, 1, 2), 10, {0: 1.0, 1: 1.0, 2: 1.5}))
    acts = st.on_register(2, False, 1, 0.0, Resume(2, (0, 1, 2), 9, None))
    m = st.current
    assert (m.generation, m.step, m.joined, m.resync) == (3, 11, (0, 2), True)
    assert m.speeds == {0: 1.0, 1: 1.0, 2: 1.5}  # those of the replica that holds step 10
    assert logs(acts, "rebuilt")[0]["behind"] == [0, 2]
    st.on_dead(2, "connection_closed", 0.1)  # a failure before the next commit: the transfer is redone
    st.on_ack(0, 3, 0.2)
    st.on_ack(1, 3, 0.2)
    assert st.current.joined == (0,) and st.current.resync
    for r in (0, 1):
        vote(st, r, 9, 4, 11, [0], 0.3)
    st.on_dead(1, "connection_closed", 0.4)
    st.on_ack(0, 4, 0.5)
    assert st.current.joined == () and not st.current.resync  # committed since: nothing to redo


def test_restart_forms_without_a_member_that_does_not_come_back_within_the_window() -> None:
    st = fresh(window=2.0)
    st.on_register(0, False, 1, 0.0, Resume(4, (0, 1, 2), 7, None))
    st.on_register(1, False, 1, 0.5, Resume(3, (0, 1, 2), 7, None))  # it had not heard of generation 4
    assert st.on_tick(1.9) == [] and st.current is None
    acts = st.on_tick(2.1)
    assert st.current.members == (0, 1) and st.current.generation == 5 and st.current.step == 8
    assert logs(acts, "rebuilt")[0]["missing"] == [2]
    # it comes back late: behind by definition, it joins at the next commit and takes the state
    st.on_register(2, False, 1, 2.5, Resume(4, (0, 1, 2), 7, None))
    assert st.pending_join == {2}
    for r in (0, 1):
        acts = vote(st, r, 9, 5, 8, [0], 3.0)
    assert st.current.members == (0, 1, 2) and st.current.joined == (2,) and st.current.resync
    assert all(m["new_generation"] == 6 for m in sent(acts, "committed").values())


def test_a_plain_joiner_during_a_rebuild_waits_for_the_next_commit() -> None:
    st = fresh(expected=2)
    st.on_register(0, False, 1, 0.0, Resume(1, (0, 1), 3, None))
    st.on_register(5, True, 1, 0.0)  # a new replica: no resume
    assert st.current is None and st.pending_join == {5}
    st.on_register(1, False, 1, 0.1, Resume(1, (0, 1), 3, None))
    assert st.current.members == (0, 1) and st.pending_join == {5}


def test_a_joiner_that_registered_before_the_first_resume_joins_after_the_rebuild() -> None:
    st = fresh(expected=2)
    st.on_register(5, True, 1, 0.0)  # a rejoining replica reconnected first: no resume, it held no state
    st.on_register(0, False, 1, 0.1, Resume(1, (0, 1), 3, None))
    st.on_register(1, False, 1, 0.1, Resume(1, (0, 1), 3, None))
    assert st.current.members == (0, 1) and st.pending_join == {5} and not st.initial
    for r in (0, 1):
        vote(st, r, 9, 2, 4, [0], 0.2)
    assert st.current.members == (0, 1, 5) and st.current.joined == (5,) and not st.current.resync


def test_replicas_leaving_at_the_end_are_no_failure_and_lose_no_quorum() -> None:
    st = make(2)  # min_members = 2
    acts = st.on_dead(1, "left", 1.0) + st.on_ack(0, 1, 1.0)
    assert logs(acts, "left") == [{"replica": 1, "generation": 1}]
    assert logs(acts, "failure_detected") == [] and logs(acts, "quorum_lost") == []
    st2 = make(2)
    acts = st2.on_dead(1, "connection_closed", 1.0) + st2.on_ack(0, 1, 1.0)
    assert logs(acts, "quorum_lost") and logs(acts, "failure_detected")


# ---- silent data corruption and non-finite microbatches ----------------------------------------------

def test_a_minority_fingerprint_is_fenced_before_the_step_commits() -> None:
    st = make(3)
    vote(st, 0, 10, 1, 4, [0, 1], 0.1, fp="aa")
    vote(st, 1, 11, 1, 4, [0, 1], 0.1, fp="bb")  # its parameters changed
    acts = vote(st, 2, 12, 1, 4, [0, 1], 0.1, fp="aa")
    assert st.committed_step == -1 and sent(acts, "committed") == {}
    assert set(sent(acts, "aborted")) == {0, 2}
    assert [(a.replica, a.reason.split(":")[0]) for a in acts if isinstance(a, Fence)] == [(1, "divergent")]
    assert logs(acts, "divergent")[0]["values"] == {"aa": [0, 2], "bb": [1]}


def test_fingerprints_without_a_strict_majority_end_the_job() -> None:
    st = make(2)
    vote(st, 0, 10, 1, 4, [0], 0.1, fp="aa")
    acts = vote(st, 1, 11, 1, 4, [0], 0.1, fp="bb")
    errors = sent(acts, "error")
    assert {r: (e["code"], e["sides"]) for r, e in errors.items()} == {
        0: ("diverged", {"aa": [0], "bb": [1]}), 1: ("diverged", {"aa": [0], "bb": [1]})}
    assert st.stopped and not [a for a in acts if isinstance(a, Fence)]


def test_a_nonfinite_microbatch_fences_its_replica_and_a_second_one_ends_the_job() -> None:
    st = make(3)
    acts = st.on_nonfinite(1, 5, 1, 7, [3], 0.1)
    assert sent(acts, "ok") and [a.replica for a in acts if isinstance(a, Fence)] == [1]
    st.on_dead(1, "fenced", 0.1)
    st.on_ack(0, 1, 0.1)
    st.on_ack(2, 1, 0.1)
    acts = st.on_nonfinite(2, 6, 2, 7, [3], 0.2)  # recomputed on replica 2: not finite there either
    assert st.stopped and logs(acts, "nonfinite_divergence") == [{"step": 7, "id": 3, "replicas": [1, 2]}]
    assert {r: m["code"] for r, m in sent(acts, "error").items()} == {2: "nonfinite", 0: "nonfinite"}


@pytest.mark.parametrize("tol, fenced", [(None, [2]), (1e-3, [])])
def test_audited_norms_are_compared_within_the_tolerance_their_dtype_names(tol: float | None, fenced: list) -> None:
    """bfloat16 kernels that are not bitwise reproducible move a norm by ~1e-4: within its 1e-3, not 1e-5."""
    st = make(3)
    acts = []
    for r, norm in enumerate((2.0, 2.0, 2.0004)):
        audit = {"id": 1, "fp": f"{r:016x}", "norm": norm, "exact": False, **({"tol": tol} if tol else {})}
        acts += vote(st, r, 10 + r, 1, 0, [0, 1], 0.1, audit=audit)
    assert sorted(a.replica for a in acts if isinstance(a, Fence)) == fenced
    assert bool(sent(acts, "committed")) == (not fenced)


def test_a_replica_whose_reports_find_nobody_generation_after_generation_is_fenced_with_the_cause() -> None:
    # issue 41: a worker out of file descriptors reported failures naming nobody; 5 generations with the same
    # members formed in 7 ms, then a 60 s collective timeout
    from recover.coord.actions import Fence
    from recover.coord.barren import LIMIT

    st = make(3)
    for k in range(LIMIT):  # each round finds everyone alive: the same members again
        g = st.current.generation
        st.on_report(2, 10 + k, g, [], 0.1 * k)
        for r in range(3):
            st.on_ack(r, g, 0.1 * k + 0.01)
        assert st.current.members == (0, 1, 2) and st.current.generation == g + 1
    acts = st.on_report(2, 20, st.current.generation, [], 1.0)
    fences = [a for a in acts if isinstance(a, Fence)]
    assert [f.replica for f in fences] == [2] and f"failed in {LIMIT} generations in a row" in fences[0].reason
    assert logs(acts, "barren_reports") == [{"replica": 2, "generation": LIMIT + 1, "rounds": LIMIT}]


def test_barren_reports_are_counted_only_in_a_row_without_a_commit_or_a_loss() -> None:
    from recover.coord.actions import Fence
    from recover.coord.barren import LIMIT

    st = make(3)
    for k in range(LIMIT + 1):
        g = st.current.generation
        if k == LIMIT - 1:  # a commit in between: the job moves
            for r in range(3):
                vote(st, r, 30 + r, g, 0, [0, 1, 2], 0.5 * k)
        acts = st.on_report(2, 10 + k, g, [], 0.5 * k + 0.1)
        assert not [a for a in acts if isinstance(a, Fence)]
        for r in range(3):
            st.on_ack(r, g, 0.5 * k + 0.2)
    g = st.current.generation
    acts = st.on_report(1, 50, g, [0], 5.0)  # a report naming a suspect is never barren
    assert not [a for a in acts if isinstance(a, Fence)]


def test_every_live_replica_not_finite_in_the_same_step_is_a_divergence_not_a_fence_of_each() -> None:
    # issue 41: with a learning rate that sends the model to infinity every replica was fenced in turn as
    # `nonfinite` (three logs with a traceback) instead of ending the job as a divergence (exit 9)
    from recover.coord.actions import Fence

    st = make(3)
    st.min_members = 1
    g = st.current.generation
    for replica, ids in ((1, [3, 4, 5]), (2, [6, 7])):
        acts = st.on_nonfinite(replica, 10 + replica, g, 1, ids, 0.1 * replica)
        assert [a.replica for a in acts if isinstance(a, Fence)] == [replica]  # one faulty device: fenced
        st.on_dead(replica, "fenced", 0.1 * replica)
    acts = st.on_nonfinite(0, 20, g, 1, [0, 1, 2], 0.5)
    assert not [a for a in acts if isinstance(a, Fence)]
    assert logs(acts, "nonfinite_divergence") == [{"step": 1, "id": None, "replicas": [0, 1, 2]}]
    assert sent(acts, "error")[0]["code"] == "nonfinite" and "not finite on every replica [0, 1, 2]" in \
        sent(acts, "error")[0]["message"]

def test_parameters_that_differ_at_step_0_are_named_as_initial_weights_with_the_fix() -> None:
    """A script that builds its model unseeded: every replica's fingerprint differs before any update; the end
    of the job says so and names the fix (it used to say "find the faulty device")."""
    st = make(2)
    vote(st, 0, 10, 1, 0, [0], 0.1, fp="aa")
    acts = vote(st, 1, 11, 1, 0, [0], 0.1, fp="bb")
    assert all("different initial weights" in e["message"] and "torch.manual_seed(0)" in e["message"]
               and "faulty device" not in e["message"] for e in sent(acts, "error").values())
    st = make(3)
    vote(st, 0, 10, 1, 0, [0, 1], 0.1, fp="aa")
    vote(st, 1, 11, 1, 0, [0, 1], 0.1, fp="bb")
    acts = vote(st, 2, 12, 1, 0, [0, 1], 0.1, fp="aa")
    assert ["different initial weights" in a.reason for a in acts if isinstance(a, Fence)] == [True]
