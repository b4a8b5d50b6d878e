"""The fault-tolerance strategies that keep running through a failure: recover and shrink-drop.

Contract: each ``run_*`` function plays one strategy over the job's failures (a
:class:`~recover.sim.members.Members`) and records it in a :class:`~recover.sim.track.Track`,
event by event: between two events every step of the same live set is identical, so it jumps
over whole runs of steps at once (no per-step Python loop). Checkpoint-and-restart lives in
:mod:`recover.sim.restart`.

``recover`` (in-step recovery, docs/DESIGN.md §4): a step over ``n`` live replicas takes
``step_time(n)`` (the policy's even split; survivors carry more microbatches, so steps slow down
as replicas are lost). A replica lost during a step adds ``recovery_latency_s`` (detection and the
new generation) and the makespan of its orphaned microbatches re-planned over the survivors
(:meth:`~recover.sim.model.StepModel.failed_step`), computed after the survivors' own quotas; the
step still commits all M microbatches (the M microbatches of every committed step are recorded
and checked). Replaced replicas rejoin at the first step boundary after ``repair_s``, pausing the
job ``rejoin_cost_s`` for the state transfer (when ``rejoin``). No periodic checkpoints: the state
lives in every replica; losing all replicas at once stops the run (``stopped``).

``shrink-drop`` (torchft-like): each replica keeps its failure-free local batch, so a step takes
the full-size step time and commits only the live replicas' microbatches (the global batch
shrinks). A failure discards the step in progress (``lost_work``: survivors notice at the step's
reduction) and costs ``reconfig_s`` (new quorum and process group); failures during that
reconfiguration fold into it. Replaced replicas heal in like recover's (``rejoin_cost_s``).

Both pause (``waiting``) while fewer than ``min_replicas`` are live and replacements are coming.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from recover.sim.members import Members
from recover.sim.model import StepModel
from recover.sim.track import Track, whole_steps

_EPS = 1e-9


def pause(m: Members, track: Track, dt: float, cause: str) -> None:
    """``dt`` seconds without steps (``cause``); replicas whose GPUs fail meanwhile die."""
    end = track.t + dt
    while not track.done:
        t_f, r = m.next_failure(before=end)
        if t_f >= end:
            break
        m.pop_failure()
        if m.is_live(r):
            track.idle(max(0.0, t_f - track.t), cause, m.n * m.spec.replica_gpus)
            m.kill(r, track.t, m.spec.rejoin)
    track.idle(max(0.0, end - track.t), cause, m.n * m.spec.replica_gpus)


def wait_for_quorum(m: Members, track: Track) -> bool:
    """Waits (``waiting``) until ``min_replicas`` are live; False once the run cannot go on."""
    spec = m.spec
    G = spec.replica_gpus
    while m.n < spec.min_replicas and not track.done:
        if m.n == 0 or not m.repairs:
            track.idle(track.end_s - track.t, "stopped", 0)
            return False
        t_ready = m.next_ready()
        t_f, r = m.next_failure(t_ready)
        if t_f < t_ready:
            track.idle(max(0.0, t_f - track.t), "waiting", m.n * G)
            m.pop_failure()
            if m.is_live(r):
                m.kill(r, track.t, spec.rejoin)
            continue
        track.idle(max(0.0, t_ready - track.t), "waiting", m.n * G)
        m.admit(t_ready)
        pause(m, track, spec.rejoin_cost_s, "rejoin")
    return not track.done


def _steps_until(track: Track, t_event: float, step_time: float, ceil: bool) -> int | float:
    """Whole steps from now until ``t_event``: those ending by it, or (``ceil``) the first boundary at or after it."""
    span = t_event - track.t
    if span == math.inf:
        return math.inf
    if not ceil:
        return whole_steps(span, step_time)
    return max(0, math.ceil(span / step_time - _EPS))


def _run(m: Members, track: Track, step_time: float, tokens: int, microbatches: int) -> str:
    """Runs whole steps up to the next event; returns 'steps', 'join', 'failure' or 'skip'.

    After 'join' the replicas ready by now (or within float noise of it) are admitted.
    """
    G = m.spec.replica_gpus
    t_ready = m.next_ready()
    t_f, r = m.next_failure()
    to_join = _steps_until(track, t_ready, step_time, True)
    count = min(_steps_until(track, t_f, step_time, False), to_join)
    if count > 0:
        track.steps(count, step_time, tokens, m.n * G, microbatches)
        return "steps"
    if to_join == 0:
        m.admit(max(track.t, t_ready))
        return "join"
    if not m.is_live(r):
        m.pop_failure()  # a GPU of a replica that is down: nothing to do
        return "skip"
    return "failure"


def run_recover(sm: StepModel, m: Members, track: Track) -> None:
    """Plays ``recover`` over the failures of ``m`` into ``track`` (see the module docstring)."""
    spec = m.spec
    while not track.done:
        if m.n < spec.min_replicas and not wait_for_quorum(m, track):
            break
        what = _run(m, track, sm.step_time(m.n), spec.tokens_per_step, sm.M)
        if what == "join":
            pause(m, track, spec.rejoin_cost_s, "rejoin")
        elif what == "failure":
            _recover_failed_step(sm, m, track)


def _recover_failed_step(sm: StepModel, m: Members, track: Track) -> None:
    """One step that loses one or more replicas and still commits all M microbatches."""
    spec = m.spec
    G = spec.replica_gpus
    t0, n = track.t, m.n
    start = list(m.live)  # positions are taken in the step's starting live set
    compute = sm.step_time(n)
    overhead = spec.overhead(n)
    end = t0 + compute
    positions: list[int] = []
    times: list[float] = []
    rounds: list[float] = []
    dead_gpu_s = 0.0
    while True:
        t_f, r = m.next_failure(before=end)
        if t_f >= end:
            break
        m.pop_failure()
        if not m.is_live(r):
            continue
        positions.append(bisect.bisect_left(start, r))
        times.append(t_f)
        m.kill(r, t_f, spec.rejoin)
        dead_gpu_s += G * (t_f - t0)
        if m.n < max(1, spec.min_replicas):  # the step cannot finish: its work so far is lost
            moved = track.hold(t_f - t0, n * G)
            track.lost["unfinished" if track.done else "lost_work"] += moved
            return
        rounds = sm.failed_step(n, positions)
        end = orphans_done(t0 + compute - overhead, times, rounds, spec.recovery_latency_s) + overhead
    recompute = sum(rounds)
    extra = {"recovery": max(0.0, end - t0 - compute - recompute), "recompute": recompute}
    track.step(compute, extra, m.n * G, spec.tokens_per_step, sm.M, extra_gpu_s=dead_gpu_s)


def orphans_done(own_done: float, failures: list[float], rounds: list[float], latency_s: float) -> float:
    """When the survivors finish the orphans of a step's failures (at ``failures`` times, in order).

    The survivors compute their own quotas first (done at ``own_done``); the orphans of the k-th
    failure start once the survivors are free and the failure has been detected and a new
    generation formed (``failure + latency_s``), and take ``rounds[k]``. A failure early in the step
    thus hides its detection behind the survivors' own work; one near the step's end does not.
    """
    cursor = own_done
    for t_f, dt in zip(failures, rounds, strict=True):
        cursor = max(cursor, t_f + latency_s) + dt
    return cursor


def run_shrink_drop(sm: StepModel, m: Members, track: Track) -> None:
    """Plays ``shrink-drop`` over the failures of ``m`` into ``track`` (see the module docstring)."""
    spec = m.spec
    version = -1
    while not track.done:
        if m.n < spec.min_replicas and not wait_for_quorum(m, track):
            break
        if version != m.version:  # the live set changed: its local batches and slowest replica
            version = m.version
            live_quotas = sm.full_quotas[np.fromiter(m.live, dtype=np.int64, count=m.n)]
            mb = int(live_quotas.sum())
            step_time = sm.compute_time(int(live_quotas.max()), m.n)
        what = _run(m, track, step_time, mb * spec.tokens_per_microbatch, mb)
        if what == "join":
            pause(m, track, spec.rejoin_cost_s, "rejoin")
        elif what == "failure":
            _drop_failed_step(m, track, step_time)


def _drop_failed_step(m: Members, track: Track, step_time: float) -> None:
    """The step in progress is discarded; the survivors reconfigure and carry on smaller."""
    spec = m.spec
    G = spec.replica_gpus
    end = track.t + step_time
    for cause, until in (("lost_work", end), ("reconfig", end + spec.reconfig_s)):
        while not track.done:
            t_f, r = m.next_failure(before=until)
            if t_f >= until:
                break
            m.pop_failure()
            if m.is_live(r):
                track.idle(max(0.0, t_f - track.t), cause, m.n * G)
                m.kill(r, t_f, spec.rejoin)
        track.idle(max(0.0, until - track.t), cause, m.n * G)
