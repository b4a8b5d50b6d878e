"""Which microbatch ids each live replica computes in a step (layer 3, docs/DESIGN.md §5).

Contract: pure, deterministic functions of their arguments (no process group, no clock, no
randomness beyond an explicit seed), shared by the trainer, the recovery layer and the simulator.

* Every id is assigned exactly once and the quotas sum to the number of ids.
* The result has one entry per live replica, in sorted replica order (an entry may be empty).
* Ids go out in contiguous blocks of the given id order, replicas taken in sorted order.
* The order of ``live`` (or of dict keys) never matters: same inputs, same output.

Policy: the quota of replica ``r`` is its share of the ``len(ids)`` cheapest *slots*, where slot
``k >= 1`` of ``r`` costs ``k * times[r]`` (the time at which ``r`` would finish its ``k``-th
microbatch) and ties go to the lower replica id. Taking the cheapest slots is the greedy
"earliest finish" allocation, which is makespan-optimal for equal-size microbatches on replicas of
different speeds; ``limits[r]`` removes the slots above ``k = limits[r]``, so the excess flows to
the replicas that finish it soonest. With no ``times`` every replica costs 1 per microbatch, which
is exactly the even split (quotas differ by at most one, the lower replica ids get the extra one).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Mapping, Sequence

from recover.names import ASSIGNMENTS  # the choices of training.assignment, from one source

Assignment = dict[int, list[int]]


# ---- the policy -------------------------------------------------------------------------------
def assign(ids: Sequence[int], live: Iterable[int], times: Mapping[int, float] | None = None,
           limits: Mapping[int, int] | None = None) -> Assignment:
    """Assigns ``ids`` to the ``live`` replicas.

    Args:
        ids: distinct microbatch ids; their order decides the blocks.
        live: distinct replica ids (any order).
        times: measured seconds per microbatch of each replica; a live replica missing from it
            takes the median of the live ones given. ``None`` means the even split.
        limits: the most microbatches a replica may take in this step (e.g. memory); a live
            replica missing from it is unlimited.

    Returns:
        ``{replica: [ids]}`` with every live replica as a key, in sorted order.

    Raises:
        ValueError: no live replica, a duplicated id or replica, a non-positive or non-finite
            time, a negative limit, or limits that cannot hold every id (names the shortfall).
    """
    reps = _replicas(live)
    ids = list(ids)
    _check_distinct_ids(ids)
    costs = _costs(reps, times)
    caps = _caps(reps, limits)
    room = int(sum(min(c, len(ids)) for c in caps))
    if room < len(ids):
        given = {r: c for r, c in zip(reps, caps, strict=True) if c != math.inf}
        raise ValueError(f"limits {given} of live replicas {reps} hold at most "
                         f"{room} of {len(ids)} microbatches (short by {len(ids) - room}); "
                         "raise a limit or add replicas")
    return _blocks(ids, reps, _quotas(len(ids), costs, caps))


def replan(assignment: Mapping[int, Sequence[int]], ledger_done: Mapping[int, Iterable[int]] | None,
           dead: Iterable[int], live: Iterable[int], times: Mapping[int, float] | None = None,
           limits: Mapping[int, int] | None = None) -> Assignment:
    """The NEW work of each survivor after ``dead`` replicas failed mid-step.

    The orphans are the ids that ``assignment`` gave to dead replicas and that no survivor's
    ledger holds; they are split (in ascending id order) over the survivors ``live - dead`` with
    :func:`assign`. Survivors keep their own ids and gradients, so they are not in the result.
    ``limits`` are per-step totals: a survivor's room is its limit minus the ids it already holds
    in ``assignment``. Pass the merged assignment of every earlier round when failures repeat.

    Returns:
        ``{survivor: [orphan ids]}`` for every survivor (empty lists when nothing is orphaned).

    Raises:
        ValueError: a replica of ``assignment`` that is neither a survivor nor dead, no survivor
            left while ids are orphaned, or what :func:`assign` raises.
    """
    dead = {int(r) for r in dead}
    survivors = sorted({int(r) for r in live} - dead)
    stray = sorted(set(assignment) - dead - set(survivors))
    if stray:
        raise ValueError(f"replicas {stray} of the assignment are neither live nor dead; pass them in one")
    done: set[int] = set()
    for r in survivors:
        done.update((ledger_done or {}).get(r, ()))
    orphans = sorted({i for r in dead & set(assignment) for i in assignment[r]} - done)
    if not survivors:
        if orphans:
            raise ValueError(f"no survivor left to take the {len(orphans)} orphaned microbatches {orphans}")
        return {}
    if limits is not None:
        limits = {r: max(0, c - len(assignment.get(r, ()))) if r in survivors else c
                  for r, c in limits.items()}
    return assign(orphans, survivors, times, limits)


def split_within_replica(ids: Sequence[int], ranks: int) -> list[list[int | None]]:
    """A replica's quota over its ``ranks`` data-parallel ranks (its FSDP shard group).

    Rank ``k`` gets the ``k``-th contiguous block of the even split, padded at the end with
    ``None`` (a zero-weight microbatch) so every rank runs ``ceil(len(ids) / ranks)`` passes.
    """
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks = {ranks!r} must be an integer >= 1")
    passes = -(-len(ids) // ranks)
    split = even_split(ids, range(ranks))
    return [list(split[k]) + [None] * (passes - len(split[k])) for k in range(ranks)]


# ---- inspecting an assignment ----------------------------------------------------------------
def quotas(assignment: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """``{replica: number of ids}`` in sorted replica order."""
    return {r: len(assignment[r]) for r in sorted(assignment)}


def makespan(assignment: Mapping[int, Sequence[int]], times: Mapping[int, float] | None = None) -> float:
    """The step's compute time: the largest ``quota * time`` (time 1 per microbatch by default)."""
    return max((len(v) * (1.0 if times is None else times[r]) for r, v in assignment.items()), default=0.0)


def check_assignment(assignment: Mapping[int, Sequence[int]], ids: Iterable[int]) -> None:
    """Raises ``ValueError`` unless ``assignment`` holds every id of ``ids`` exactly once and nothing else."""
    want = set(ids)
    seen: dict[int, int] = {}
    for rep in sorted(assignment):
        for i in assignment[rep]:
            seen[i] = seen.get(i, 0) + 1
    problems = []
    missing = sorted(want - set(seen))
    dupes = sorted(i for i, n in seen.items() if n > 1)
    extra = sorted(set(seen) - want)
    if missing:
        problems.append(f"missing ids {missing}")
    if dupes:
        problems.append(f"ids assigned more than once {dupes}")
    if extra:
        problems.append(f"unknown ids {extra}")
    if problems:
        raise ValueError("bad assignment: " + "; ".join(problems))


# ---- the failure-free plans the trainer uses -------------------------------------------------
def even_split(ids: Sequence[int], replicas: Iterable[int]) -> Assignment:
    """Contiguous blocks of ``ids`` over ``replicas`` (in sorted order); the first ones get one more."""
    return assign(ids, replicas)


def plan_step(M: int, members: Iterable[int], step: int, how: str = "blocks", seed: int = 0,
              times: Mapping[int, float] | None = None) -> Assignment:
    """The ids ``0..M-1`` of ``step`` over ``members``: the quotas of :func:`assign` (the even split
    without ``times``), filled in the id order of ``how``.

    ``blocks`` gives contiguous blocks, ``strided`` deals the ids round-robin (``ids[k::n]`` for equal
    quotas) and ``shuffled`` permutes the ids with a generator seeded by (seed, step) first: the
    trajectory must not depend on which of them is used, nor on ``times``.
    """
    if how not in ASSIGNMENTS:
        raise ValueError(f"assignment {how!r} is not one of {ASSIGNMENTS}")
    reps = _replicas(members)
    sizes = [len(v) for v in assign(range(M), reps, times).values()]
    ids = list(range(M))
    if how == "shuffled":
        random.Random(f"{seed}:{step}").shuffle(ids)
    if how != "strided":
        return _blocks(ids, reps, sizes)
    out: Assignment = {r: [] for r in reps}
    order = iter(ids)
    while any(len(out[r]) < n for r, n in zip(reps, sizes, strict=True)):
        for r, n in zip(reps, sizes, strict=True):
            if len(out[r]) < n:
                out[r].append(next(order))
    return out


def static_assignment(M: int, replicas: int, step: int, how: str = "blocks",
                      seed: int = 0) -> list[list[int]]:
    """The failure-free even plan of ids ``0..M-1`` over replicas ``0..replicas-1`` (see :func:`plan_step`)."""
    plan = plan_step(M, range(replicas), step, how, seed)
    return [plan[r] for r in range(replicas)]


# ---- helpers ----------------------------------------------------------------------------------
def _replicas(live: Iterable[int]) -> list[int]:
    reps = [int(r) for r in live]
    if not reps:
        raise ValueError("no live replicas to assign microbatches to")
    if len(set(reps)) != len(reps):
        raise ValueError(f"live replicas {sorted(reps)} repeat a replica id")
    return sorted(reps)


def _check_distinct_ids(ids: list[int]) -> None:
    if len(set(ids)) != len(ids):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"microbatch ids {dupes} appear more than once")


def _costs(reps: list[int], times: Mapping[int, float] | None) -> list[float]:
    if times is None:
        return [1.0] * len(reps)
    given = {r: float(times[r]) for r in reps if r in times}
    for r, t in given.items():
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"times[{r}] = {t!r} must be a finite number of seconds > 0")
    if not given:
        return [1.0] * len(reps)
    known = sorted(given.values())
    median = (known[(len(known) - 1) // 2] + known[len(known) // 2]) / 2
    return [given.get(r, median) for r in reps]


def _caps(reps: list[int], limits: Mapping[int, int] | None) -> list[float]:
    """Each replica's most microbatches; ``math.inf`` when unlimited."""
    caps: list[float] = []
    for r in reps:
        c = (limits or {}).get(r)
        if c is None:
            caps.append(math.inf)
            continue
        if not isinstance(c, int) or c < 0:
            raise ValueError(f"limits[{r}] = {c!r} must be an integer >= 0")
        caps.append(c)
    return caps


def _quotas(n: int, costs: list[float], caps: list[float]) -> list[int]:
    """The replicas' shares of the ``n`` cheapest slots ``(k * cost, replica index)``, ``k <= cap``.

    A safe lower bound (proportional share minus one) is taken without the heap, so the heap
    only places the last ``O(len(costs))`` slots: cheap for simulator-sized calls. Every slot of
    the bound costs less than ``n / sum(1 / cost)``, a lower bound on the ``n``-th cheapest slot,
    so the result equals the plain one-slot-at-a-time greedy.
    """
    speed = sum(1.0 / c for c in costs)
    q = [min(cap, max(0, math.floor(n / (c * speed)) - 1)) for c, cap in zip(costs, caps, strict=True)]
    left = n - sum(q)
    heap = [((q[i] + 1) * costs[i], i) for i in range(len(costs)) if q[i] < caps[i]]
    heapq.heapify(heap)
    while left > 0:
        _, i = heapq.heappop(heap)
        q[i] += 1
        left -= 1
        if q[i] < caps[i]:
            heapq.heappush(heap, ((q[i] + 1) * costs[i], i))
    return q


def _blocks(ids: list[int], reps: list[int], sizes: list[int]) -> Assignment:
    out: Assignment = {}
    start = 0
    for rep, size in zip(reps, sizes, strict=True):
        out[rep] = ids[start:start + size]
        start += size
    return out


def audit_plan(plan: Mapping[int, Sequence[int]], step: int, seed: int = 0,
               auditors: int = 2) -> tuple[int, int, list[int]] | None:
    """The audit of ``step`` (``fault_tolerance.audit_every``): ``(id, owner, auditors)``, one microbatch
    id drawn from (seed, step), the member whose share holds it, and the ``auditors`` members after it
    (in member order, wrapping around) that compute it a second and third time. Pure: every member
    derives the same audit from the same plan. None when fewer than two members hold work."""
    members = sorted(plan)
    ids = sorted(i for share in plan.values() for i in share)
    if len(members) < 2 or not ids:
        return None
    audited = ids[random.Random(f"audit:{seed}:{step}").randrange(len(ids))]
    owner = next(r for r in members if audited in plan[r])
    at = members.index(owner)
    return audited, owner, [members[(at + k) % len(members)] for k in range(1, min(auditors, len(members) - 1) + 1)]
