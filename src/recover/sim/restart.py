"""Checkpoint-and-restart, the baseline (TorchElastic + torch.distributed.checkpoint style).

Contract: :func:`run_checkpoint_restart` plays the strategy over the job's failures into a
:class:`~recover.sim.track.Track`, jumping over whole runs of steps between events.

Model:

* Every ``k`` steps the job saves a checkpoint, blocking for ``save_s`` (``checkpoint``), with
  ``k = round(interval / step_time_s)`` and the interval Young/Daly's ``sqrt(2 * save_s * MTBF_job)``
  unless ``checkpoint_interval_s`` is given (no failures expected: no checkpoints).
* A failure of a live replica at ``t_f`` rolls the model back to the last COMPLETED checkpoint:
  all the time since that checkpoint finished (or since the last restart finished) is
  ``lost_work``, including a save cut short. Then the job relaunches: ``restart_s`` (``restart``;
  ``restart_by_replicas`` when given, by the replicas relaunched)
  followed by ``load_s`` (``load``).
* ``restart_mode = 'survivors'``: the relaunch goes on with the live replicas, keeping M by
  gradient accumulation (steps take ``step_time(n)``, like recover's); replicas replaced (with
  ``rejoin``) by the time a relaunch completes come back with it. Right after a checkpoint, a
  planned relaunch (``restart_s + load_s``, nothing lost) takes back replaced replicas when the
  faster steps repay it within one job MTBF. ``'replace'``: the
  relaunch also waits for every dead replica's replacement, so steps stay full speed; the time
  the replacement arrives after ``restart_s`` is ``waiting``.
* A failure during a relaunch starts it over (the time spent is lost to its cause); the model
  state is the checkpoint either way.

Closed form with one failure at ``t_f`` (replace mode, ``repair_s <= restart_s``): with period
``P = k * step_time + save_s`` the last checkpoint completes at ``floor(t_f / P) * P``, so
``lost_work = t_f - floor(t_f / P) * P`` and the job computes again from ``t_f + restart_s + load_s``.
"""

from __future__ import annotations

import math

from recover.sim.members import Members
from recover.sim.model import StepModel
from recover.sim.track import Track, whole_steps


def run_checkpoint_restart(sm: StepModel, m: Members, track: Track) -> None:
    """Plays checkpoint-and-restart over the failures of ``m`` into ``track``."""
    spec = m.spec
    G = spec.replica_gpus
    every = sm.checkpoint_every()
    durable = (0, 0)  # (tokens, steps) of the last completed checkpoint
    t_safe = 0.0  # when the work a failure would lose began
    since = 0  # steps since that checkpoint
    while not track.done:
        step_time = sm.step_time(m.n)
        t_f, r = m.next_failure()
        todo = every - since
        fit = whole_steps(t_f - track.t, step_time)
        since += track.steps(min(todo, fit), step_time, spec.tokens_per_step, m.n * G, sm.M)
        if track.done:
            break
        if since >= every and t_f >= track.t + spec.save_s:
            if track.idle(spec.save_s, "checkpoint", m.n * G):
                durable, t_safe, since = (track.tokens, track.steps_done), track.t, 0
                if _worth_regrowing(sm, m, track.t):
                    _relaunch(m, track)  # planned: nothing to lose right after a checkpoint
                    t_safe = track.t
            continue
        m.pop_failure()
        if not m.is_live(r):
            continue
        moved = track.hold(t_f - track.t, m.n * G)
        if track.done:  # the run ended before this failure
            track.lost["unfinished"] += moved
            break
        track.lost["lost_work"] += t_f - t_safe
        track.rollback(*durable)
        m.kill(r, t_f, spec.rejoin)
        _relaunch(m, track)
        t_safe, since = track.t, 0


def _relaunch(m: Members, track: Track) -> None:
    """Restart (and load) until one completes without a failure of a live replica."""
    spec = m.spec
    G = spec.replica_gpus
    while not track.done:
        if spec.restart_mode == "replace":
            t_need = max((t for t, _ in m.repairs), default=-math.inf)
        else:
            t_need = m.ready_after(spec.min_replicas - m.n)
        if t_need == math.inf:
            track.idle(track.end_s - track.t, "stopped", 0)
            return
        t0 = track.t
        restart_s = spec.restart_for(m.n)
        relaunched = max(t0 + restart_s, t_need)
        loaded = relaunched + spec.load_s
        t_f, r = m.next_failure(before=loaded)
        if t_f < loaded:
            _book(track, t_f - t0, restart_s, relaunched - t0, m.n * G)
            m.pop_failure()
            if m.is_live(r):
                m.kill(r, t_f, spec.rejoin)
            continue
        _book(track, relaunched - t0, restart_s, relaunched - t0, m.n * G)
        m.admit(relaunched)
        track.idle(spec.load_s, "load", m.n * G)
        return


def _worth_regrowing(sm: StepModel, m: Members, now: float) -> bool:
    """Survivors mode: relaunch to take back replaced replicas when that pays within one job MTBF."""
    spec = m.spec
    ready = sum(1 for t, _ in m.repairs if t <= now)
    if spec.restart_mode != "survivors" or ready == 0:
        return False
    slow, fast = sm.step_time(m.n), sm.step_time(m.n + ready)
    return (slow - fast) / slow * spec.job_mtbf_s() > spec.restart_for(m.n + ready) + spec.load_s


def _book(track: Track, elapsed: float, restart_s: float, relaunch_s: float, gpus: int) -> None:
    """``elapsed`` seconds of a relaunch: restart first, then waiting for replacements, then load."""
    restart = min(elapsed, restart_s)
    waiting = max(0.0, min(elapsed, relaunch_s) - restart_s)
    load = max(0.0, elapsed - relaunch_s)
    for cause, dt in (("restart", restart), ("waiting", waiting), ("load", load)):
        if dt > 0:
            track.idle(dt, cause, gpus)
