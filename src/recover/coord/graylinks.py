"""The slow-link rule: a replica whose link makes every step slower than the job would be without it.

Pure: no sockets, no threads, no clock (every event carries ``now``), like :mod:`recover.coord.links` beside it.
The membership state (:mod:`recover.coord.state`) owns one :class:`SlowLinks`, fed at every commit; the rank
logic (:mod:`recover.coord.ranks`) sends the probes it asks for and fences the replica it names.

Measured (every commit vote, :class:`~recover.coord.protocol.Ballot`): each member's wall seconds of compute in
the step (``comp_s``, its microbatches) and of communication (``comm_s``, its wait in the committed reduction),
and its seconds per microbatch (``mb_s``). Of one commit (:class:`Split`): ``compute`` = the slowest member's
compute, ``reduction`` = the shortest wait (the member that finished computing last waits for the reduction
alone: its own duration), the measured step = ``compute + reduction``.

Rule (threshold ``factor``, default 1.5; ``steps`` K, default 3):
  1. *Communication-bound*: a commit whose reduction exceeds ``(factor - 1) x compute``. Nothing else can
     be ``factor`` x faster without one replica (without it the others compute at least as long), so
     below that nobody is probed. After K communication-bound commits in a row the members are probed.
  2. *Probe*: every member times a round trip of ``probe_bytes`` each way with every other member's probe
     listener (:meth:`recover.coord.probe.LinkProbe.rates`); a pair's time is the lower of its two
     measurements, a replica's link time ``L[r]`` the time of its best pair (a replica whose own link is
     slow has no fast pair; any other has one). A probe that fails counts as its timeout.
  3. *Verdict* (:func:`judge`, on the medians of the K commits): for each member r, the step without it is
     estimated as M microbatches over the others' measured rates (``M / sum(1 / mb_s[o])``) plus the
     reduction scaled by the slowest link left (``reduction x max(L[o], o != r) / max(L)``: a ring reduction
     runs at its slowest link). The member whose removal gains most is *named* when the measured step exceeds
     ``factor`` x its estimate without it, never below ``min_members`` (nor the last member). All links
     equally slow: nobody is better without any one, nobody is named. Two members: their one pair cannot tell
     whose link it is, nobody is named. A member named by two probes in a row (the second at the next
     communication-bound commit) is fenced, cause ``slow_link``: one probe's noise (a process descheduled
     while it answered every peer) fences nobody.
  4. A verdict that fences nobody doubles the number of communication-bound commits before the next probe
     (at most 64 x K): a job whose every link is slow is not probed at every K commits.
  5. *Readmission*: a replica fenced for its link that registers again is held back (like a known cut) and
     asked to probe the members every few seconds; it is admitted at the next commit once the step with it,
     estimated from its probe (:func:`readmit`: its compute rate as before, the reduction scaled from the one
     measured with its slow link by the ratio of its link times now and then, never below today's), is within
     ``factor`` x today's measured step.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

FACTOR = 1.5
"""The default threshold: the step with the replica over the estimated step without it."""
STEPS = 3
"""The default K: communication-bound commits in a row before the members are probed."""
PROBE_BYTES = 128 * 1024
"""Bytes each way of one rate probe (well above a token bucket's burst on a failing port)."""
PROBE_TIMEOUT_S = 5.0
"""How long one rate probe may take; a probe that takes longer counts as this long."""
GATHER_S = PROBE_TIMEOUT_S + 2.0
"""How long the coordinator waits for the members' probe answers (a member that says nothing has no times)."""
MAX_BACKOFF = 64
"""The most K is multiplied by after verdicts that fence nobody."""


@dataclass(frozen=True)
class Split:
    """One commit's measurements by member: seconds per microbatch, compute and communication seconds."""

    microbatches: int
    mb_s: Mapping[int, float]
    comp_s: Mapping[int, float]
    comm_s: Mapping[int, float]

    @property
    def compute(self) -> float:
        """The slowest member's compute (0 when nobody measured one)."""
        return max(self.comp_s.values(), default=0.0)

    @property
    def reduction(self) -> float:
        """The reduction's own duration: the shortest wait in it (0 when nobody measured one)."""
        return min(self.comm_s.values(), default=0.0)

    @property
    def step(self) -> float:
        return self.compute + self.reduction

    def comm_bound(self, factor: float) -> bool:
        """Whether a replica's removal could make this step ``factor`` x faster at all (rule 1)."""
        return bool(self.comm_s) and self.reduction > (factor - 1.0) * self.compute


def link_times(members: list[int] | tuple[int, ...], probes: Mapping[int, Mapping[int, float]]) -> dict[int, float]:
    """Each member's link time (rule 2) from ``probes`` (prober -> peer -> seconds); a member with no
    measured pair is left out."""
    out: dict[int, float] = {}
    for r in members:
        pairs = []
        for p in members:
            if p == r:
                continue
            seen = [t for t in (probes.get(r, {}).get(p), probes.get(p, {}).get(r)) if t is not None]
            if seen:
                pairs.append(min(seen))
        if pairs:
            out[r] = min(pairs)
    return out


@dataclass(frozen=True)
class SlowVerdict:
    """What :func:`judge` found: ``replica`` is the member whose removal gains most (None: no member has a
    link time or a rate to estimate with), ``step_s`` the measured step, ``without_s`` the estimated step
    without it, ``fenced`` whether the rule fences it."""

    replica: int | None
    step_s: float
    without_s: float
    fenced: bool
    links: dict[int, float] = field(default_factory=dict)
    named: bool = False
    """Over the threshold in this probe (``fenced``: in this one and the one before)."""

    @property
    def ratio(self) -> float:
        return self.step_s / self.without_s if self.without_s > 0 else 0.0


def judge(members: list[int] | tuple[int, ...], split: Split, links: Mapping[int, float], factor: float = FACTOR,
          min_members: int = 1) -> SlowVerdict:
    """Rule 3: the member to fence for its link, if any (deterministic: ties go to the higher id)."""
    step = split.step
    best: tuple[float, int, float] | None = None  # (ratio, replica, estimate without it)
    slowest = max(links.values(), default=0.0)
    for r in sorted(members):
        others = [o for o in members if o != r]
        rate = sum(1.0 / split.mb_s[o] for o in others if split.mb_s.get(o))
        left = [links[o] for o in others if o in links]
        if r not in links or not rate or not left or slowest <= 0:
            continue
        without = split.microbatches / rate + split.reduction * max(left) / slowest
        ratio = step / without if without > 0 else 0.0
        if best is None or ratio >= best[0]:
            best = (ratio, r, without)
    if best is None:
        return SlowVerdict(None, step, 0.0, False, dict(links))
    ratio, r, without = best
    fenced = len(members) > 2 and len(members) - 1 >= max(1, min_members) and ratio > factor
    return SlowVerdict(r, step, without, fenced, dict(links), fenced)


def readmit(joiner_link_s: float, fenced_link_s: float, fenced_reduction_s: float, joiner_mb_s: float | None,
            now: Split, factor: float = FACTOR) -> tuple[bool, float]:
    """Rule 5: whether a replica fenced for its link (its link time ``fenced_link_s`` then, the reduction
    ``fenced_reduction_s`` measured with it) is admitted now that its probe takes ``joiner_link_s``, against
    the members' last commit ``now``. Returns the verdict and the estimated step with it."""
    rate = sum(1.0 / t for t in now.mb_s.values() if t) + (1.0 / joiner_mb_s if joiner_mb_s else 0.0)
    compute = now.microbatches / rate if rate else now.compute
    scale = joiner_link_s / fenced_link_s if fenced_link_s > 0 else 1.0
    reduction = max(now.reduction, fenced_reduction_s * scale)
    with_it = compute + reduction
    return with_it <= factor * now.step, with_it


@dataclass
class _Fenced:
    link_s: float
    reduction_s: float
    mb_s: float | None


class SlowLinks:
    """The rule's state across commits (see the module docstring).

    Args:
        factor: the threshold of rules 1, 3 and 5 (0: the rule is off, nobody is probed or fenced).
        steps: K, communication-bound commits in a row before a probe.
    """

    def __init__(self, factor: float = FACTOR, steps: int = STEPS) -> None:
        if not (factor == 0 or factor > 1.0) or steps < 1:
            raise ValueError(f"slow-link factor must be 0 (off) or > 1 and steps >= 1, got {factor} and {steps}")
        self.factor, self.steps = factor, steps
        self._recent: deque[Split] = deque(maxlen=steps)
        self._members: tuple[int, ...] = ()
        self._bound = 0  # communication-bound commits in a row
        self._backoff = 1
        self.probing: tuple[int, int] | None = None  # (generation, step) whose members are being probed
        self._since = 0.0
        self._answers: dict[int, dict[int, float]] = {}
        self._asked: tuple[int, ...] = ()
        self.fenced: dict[int, _Fenced] = {}  # replica -> what it was fenced with (held back until readmitted)
        self._suspect: int | None = None  # named by the last probe: the next one confirms it
        self.last: Split | None = None  # the last commit's measurements (readmission compares with it)

    def observe(self, generation: int, step: int, members: tuple[int, ...], split: Split) -> bool:
        """A commit of ``members``; True when a probe of them is due now (rule 1)."""
        if members != self._members:
            self._members, self._bound = members, 0
            self._recent.clear()
        self.last = split
        if not self.factor or not split.comm_bound(self.factor):
            self._bound = 0
            self._recent.clear()
            return False
        self._bound += 1
        self._recent.append(split)
        due = self._bound >= self.steps * self._backoff or self._suspect is not None
        if self.probing is not None or not due or len(members) < 3:
            return False
        self._bound = 0
        self.probing = (generation, step)
        self._answers, self._asked = {}, members
        return True

    def started(self, now: float) -> None:
        """The probes of :attr:`probing` went out at ``now``."""
        self._since = now

    def answered(self, replica: int, times: Mapping[int, float]) -> None:
        """``replica``'s probe of its peers took ``times`` (peer -> seconds)."""
        if self.probing is not None and replica in self._asked:
            self._answers[replica] = dict(times)

    def settle(self, now: float, members: tuple[int, ...], min_members: int) -> SlowVerdict | None:
        """The verdict once every member asked answered or :data:`GATHER_S` passed (None: not yet, or nothing
        was probed). A verdict that fences nobody backs the next probe off (rule 4)."""
        if self.probing is None:
            return None
        if set(self._asked) - set(self._answers) and now - self._since < GATHER_S:
            return None
        self.probing = None
        alive = tuple(m for m in self._asked if m in members)
        if alive != self._asked or not self._recent:  # a member left meanwhile: the measurements are moot
            self._suspect = None
            return None
        split = median_split(list(self._recent))
        verdict = judge(alive, split, link_times(alive, self._answers), self.factor, min_members)
        r = verdict.replica
        if verdict.named and r is not None and r == self._suspect:
            self.fenced[r] = _Fenced(verdict.links[r], split.reduction, split.mb_s.get(r))
            self._suspect, self._backoff = None, 1
            return verdict
        if verdict.named:
            self._suspect = r  # the next communication-bound commit probes again
        else:
            self._suspect = None
            self._backoff = min(MAX_BACKOFF, self._backoff * 2)
        return replace(verdict, fenced=False)

    def held(self, replica: int) -> bool:
        """Whether ``replica`` was fenced for its link and has not been readmitted."""
        return replica in self.fenced

    def probed_joiner(self, replica: int, times: Mapping[int, float]) -> tuple[bool, float, float] | None:
        """A held joiner's probe of the members took ``times``: (admitted, its link time, the estimated step
        with it); None when it is not held or nothing was measured. Admitted: it is held no more."""
        f = self.fenced.get(replica)
        if f is None or not times or self.last is None:
            return None
        link = min(times.values())
        ok, with_it = readmit(link, f.link_s, f.reduction_s, f.mb_s, self.last, self.factor)
        if ok:
            del self.fenced[replica]
        return ok, link, with_it


def median_split(splits: list[Split]) -> Split:
    """The member-wise medians of several commits of the same members (M of the last)."""
    def med(key: str) -> dict[int, float]:
        by: dict[int, list[float]] = {}
        for s in splits:
            for r, t in getattr(s, key).items():
                by.setdefault(r, []).append(t)
        return {r: statistics.median(ts) for r, ts in by.items()}

    return Split(splits[-1].microbatches, med("mb_s"), med("comp_s"), med("comm_s"))
