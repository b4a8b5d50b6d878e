"""Silent data corruption in one step's votes: which members hold which value.

Pure functions of the members' :class:`~recover.coord.protocol.Ballot` (member -> ballot), used by
:class:`recover.coord.state.MembershipState` when every member voted. Each answers the *sides*
(value -> the members that hold it, in member order), or None when there is nothing to compare;
the state fences a minority or ends the job when the sides differ.

  * :func:`fingerprint_sides`: the parameter fingerprints, compared once every member sent one.
  * :func:`audit_sides`: the gradient of the step's audited microbatch, among the members that
    computed it (two at least): by fingerprint when all are ``exact``, else by norm, within the
    largest relative ``tol`` they name (:data:`AUDIT_TOLERANCE` by default).
"""

from __future__ import annotations

from recover.coord.protocol import Ballot

AUDIT_TOLERANCE = 1e-5
"""Relative difference of the audited gradient's norm tolerated outside deterministic mode, unless the
audits name a larger one (``tol``: their compute dtype's, e.g. bfloat16's)."""


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
