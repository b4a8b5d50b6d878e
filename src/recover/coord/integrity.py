"""Silent data corruption in one step's votes: which members hold which value, and what follows.

Pure functions of the members' votes (member -> (request id, :class:`~recover.coord.protocol.Ballot`)),
used by :class:`recover.coord.state.MembershipState` once every member voted alike: :func:`check`
compares the parameter fingerprints, then the audited gradients. Each comparison answers the
*sides* (value -> the members that hold it, in member order), or None when there is nothing to
compare; :func:`split` turns sides that differ into a verdict: a strict majority is trusted and the
others fenced, or with no strict majority the job ends.

  * :func:`fingerprint_sides`: the parameter fingerprints, compared once every member sent one.
  * :func:`audit_sides`: the gradient of the step's audited microbatch, among the members that
    computed it (two at least): by fingerprint when all are ``exact``, else by norm, within the
    largest relative ``tol`` they name (:data:`AUDIT_TOLERANCE` by default).

Parameters that differ at step 0 (before any update) are the replicas' initial weights, not a faulty
device: the verdict's line says so and names the fix (:data:`INITIAL_WEIGHTS`). Audits marked ``samples``
(a script's replicas each digest the step's probe batch, :mod:`recover.train.replicas.contract`) that differ end the
job whatever the majority (the check ``samples``, :data:`SAMPLES_FIX`): the user's ``samples`` is not one
function everywhere, which no majority repairs.
"""

from __future__ import annotations

from recover.coord.actions import Action, Fence, Log, Send
from recover.coord.protocol import Ballot
from recover.names import Event

AUDIT_TOLERANCE = 1e-5
"""Relative difference of the audited gradient's norm tolerated outside deterministic mode, unless the
audits name a larger one (``tol``: their compute dtype's, e.g. bfloat16's)."""

INITIAL_WEIGHTS = ("at step 0, before any update: the replicas built different initial weights; seed the RNG the "
                   "same way before building the model (e.g. torch.manual_seed(0) before constructing it) in every "
                   "replica")


SAMPLES_FIX = ("samples is not one pure function of (step, id) on every replica (does it read the replica id, the "
               "rank, the environment or a per-process RNG?): derive the batch from step and id alone")


def check(generation: int, step: int, votes: dict[int, tuple[int, Ballot]]) -> tuple[list[Action], bool] | None:
    """The verdict of the fingerprints, else of the audits (see :func:`split`); None when all agree."""
    ballots = {r: b for r, (_, b) in votes.items()}
    sides = fingerprint_sides(ballots)
    if sides is not None and (verdict := split(generation, step, votes, sides, "divergent",
                                               "its parameters")) is not None:
        return verdict
    audited = audit_sides(ballots)
    if audited is None:
        return None
    if all(b.audit.get("samples") for b in ballots.values() if b.audit is not None):  # a script's batches
        return split(generation, step, votes, audited[0], "samples", audited[1], end=True, fix=SAMPLES_FIX)
    return split(generation, step, votes, audited[0], "audit", audited[1])


def fingerprint_sides(ballots: dict[int, Ballot]) -> dict[str, list[int]] | None:
    """The members by parameter fingerprint; None unless every member sent one."""
    if any(b.fp is None for b in ballots.values()):
        return None
    sides: dict[str, list[int]] = {}
    for r, b in sorted(ballots.items()):
        sides.setdefault(str(b.fp), []).append(r)
    return sides


def audit_sides(ballots: dict[int, Ballot]) -> tuple[dict[str, list[int]], str] | None:
    """The members that computed the audited microbatch by its gradient, and what was compared; None
    when fewer than two did."""
    audits = {r: b.audit for r, b in sorted(ballots.items()) if b.audit is not None}
    if len(audits) < 2:
        return None
    sides: dict[str, list[int]] = {}
    if all(a.get("exact") for a in audits.values()):
        for r, a in audits.items():
            sides.setdefault(str(a["fp"]), []).append(r)
    else:
        first, tol = 0.0, max(float(a.get("tol", AUDIT_TOLERANCE)) for a in audits.values())
        for r, a in sorted(audits.items(), key=lambda kv: kv[1]["norm"]):
            n = float(a["norm"])
            if not sides or abs(n - first) > tol * max(abs(first), 1e-30):
                first = n
                sides[f"norm {n:.9g}"] = []
            sides[f"norm {first:.9g}"].append(r)
    one = next(iter(audits.values()))
    if one.get("samples"):
        return sides, f"its batch of microbatch {one['id']} (samples(step, {one['id']}))"
    return sides, f"its gradient of the audited microbatch {one['id']}"


def split(generation: int, step: int, votes: dict[int, tuple[int, Ballot]], sides: dict[str, list[int]],
          kind: str, what: str, *, end: bool = False, fix: str | None = None) -> tuple[list[Action], bool] | None:
    """Replicas that should hold the same value (``sides``: value -> replicas) and do not. A strict
    majority of them holding one value is trusted: the others are fenced (``kind``) before the step
    commits, every other vote is aborted, and the members left recompute the fenced ones'
    microbatches in the step. No strict majority (or ``end``: a majority proves nothing, as for a script's
    batches): the job ends (``diverged`` to every voter, with the sides; ``fix`` ends the line). Returns the
    actions and whether the job ends; None when all agree."""
    if len(sides) < 2:
        return None
    initial = step == 0 and kind == "divergent"
    trusted, largest = max(sides.items(), key=lambda kv: len(kv[1]))
    if not end and 2 * len(largest) > sum(len(rs) for rs in sides.values()):
        minority = sorted(r for v, rs in sides.items() if v != trusted for r in rs)
        acts: list[Action] = [Log(Event(kind), {"generation": generation, "step": step, "replicas": minority,
                                                "majority": largest, "values": sides})]
        acts += [Send(r, {"type": "aborted", "re": rid, "generation": generation,
                          "reason": f"{kind} replicas {minority} fenced"})
                 for r, (rid, _) in votes.items() if r not in minority]
        why = f" ({INITIAL_WEIGHTS})" if initial else ""
        return acts + [Fence(r, f"{kind}: {what} ({v}) differs from that of replicas {largest} ({trusted}) at "
                                f"step {step}{why}") for v, rs in sides.items() if v != trusted for r in rs], False
    text = "; ".join(f"replicas {rs} hold {v}" for v, rs in sides.items())
    fix = fix or (INITIAL_WEIGHTS if initial else ("each side's state is saved under checkpoints/diverged/; find the "
                                                  "faulty device before resuming"))
    trust = "" if end else " with no majority to trust"
    msg = f"the replicas disagree on {what.replace('its ', '')} at step {step}{trust} ({text}); {fix}"
    return [Log(Event.DIVERGED, {"generation": generation, "step": step, "sides": sides, "check": kind,
                                 "message": msg}),
            *(Send(r, {"type": "error", "re": rid, "code": "diverged", "message": msg, "sides": sides})
              for r, (rid, _) in votes.items())], True
