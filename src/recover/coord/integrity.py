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
device: the verdict's line says so and names the fix (:data:`INITIAL_WEIGHTS`).
"""

from __future__ import annotations

from recover.coord.actions import Action, Fence, Log, Send
from recover.coord.protocol import Ballot

AUDIT_TOLERANCE = 1e-5
"""Relative difference of the audited gradient's norm tolerated outside deterministic mode, unless the
audits name a larger one (``tol``: their compute dtype's, e.g. bfloat16's)."""

INITIAL_WEIGHTS = ("at step 0, before any update: the replicas built different initial weights; seed the RNG the "
                   "same way before building the model (e.g. torch.manual_seed(0) before constructing it) in every "
                   "replica")


def check(generation: int, step: int, votes: dict[int, tuple[int, Ballot]]) -> tuple[list[Action], bool] | None:
    """The verdict of the fingerprints, else of the audits (see :func:`split`); None when all agree."""
    ballots = {r: b for r, (_, b) in votes.items()}
    sides = fingerprint_sides(ballots)
    if sides is not None and (verdict := split(generation, step, votes, sides, "divergent",
                                               "its parameters")) is not None:
        return verdict
    audited = audit_sides(ballots)
    return None if audited is None else split(generation, step, votes, audited[0], "audit", audited[1])


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
    return sides, f"its gradient of the audited microbatch {next(iter(audits.values()))['id']}"


def split(generation: int, step: int, votes: dict[int, tuple[int, Ballot]], sides: dict[str, list[int]],
      kind: str, what: str) -> tuple[list[Action], bool] | None:
    """Replicas that should hold the same value (``sides``: value -> replicas) and do not. A strict
    majority of them holding one value is trusted: the others are fenced (``kind``) before the step
    commits, every other vote is aborted, and the members left recompute the fenced ones'
    microbatches in the step. No strict majority: the job ends (``diverged`` to every voter, with
    the sides). Returns the actions and whether the job ends; None when all agree."""
    if len(sides) < 2:
        return None
    initial = step == 0 and kind == "divergent"
    trusted, largest = max(sides.items(), key=lambda kv: len(kv[1]))
    if 2 * len(largest) > sum(len(rs) for rs in sides.values()):
        minority = sorted(r for v, rs in sides.items() if v != trusted for r in rs)
        acts: list[Action] = [Log(kind, {"generation": generation, "step": step, "replicas": minority,
                                         "majority": largest, "values": sides})]
        acts += [Send(r, {"type": "aborted", "re": rid, "generation": generation,
                          "reason": f"{kind} replicas {minority} fenced"})
                 for r, (rid, _) in votes.items() if r not in minority]
        why = f" ({INITIAL_WEIGHTS})" if initial else ""
        return acts + [Fence(r, f"{kind}: {what} ({v}) differs from that of replicas {largest} ({trusted}) at "
                                f"step {step}{why}") for v, rs in sides.items() if v != trusted for r in rs], False
    text = "; ".join(f"replicas {rs} hold {v}" for v, rs in sides.items())
    fix = INITIAL_WEIGHTS if initial else ("each side's state is saved under checkpoints/diverged/; find the faulty "
                                           "device before resuming")
    msg = (f"the replicas disagree on {what.replace('its ', '')} at step {step} with no majority to trust "
           f"({text}); {fix}")
    return [Log("diverged", {"generation": generation, "step": step, "sides": sides, "check": kind}),
            *(Send(r, {"type": "error", "re": rid, "code": "diverged", "message": msg, "sides": sides})
              for r, (rid, _) in votes.items())], True
