"""What the step protocol needs from its collaborators, as ``typing.Protocol`` interfaces.

The step protocol (:mod:`recover.recovery.protocol`) talks to exactly three things:

- a :class:`Group`: the collectives of one membership generation. Layer 1's
  :class:`~recover.comm.group.FaultTolerantGroup` in a job of ``recover launch``; a static group
  (``recover.train.replicas.dist.StaticGroup``) under ``recover train``; fakes in the unit tests.
- a :class:`Coordinator`: the commit vote (``recover.coord.client.CoordinatorClient``, or a
  coordinator-less stand-in that commits every step).
- a :class:`StepReplica`: one replica's model, optimizer and step gradients
  (:class:`~recover.train.replicas.replica.Replica`).

Contract of :class:`Group` (every call may raise :class:`~recover.errors.PeerFailure`, naming the
dead, after which only ``next_generation`` may be called): collectives never modify their inputs;
``members`` are replica ids in rank order; ``next_generation`` returns the coordinator's next
membership's group once every member of it joined (a generation that loses a member while forming
is skipped, by every survivor alike), and raises :class:`~recover.errors.QuorumLost` when none can
form. So every survivor passes through the same generations, and the step protocol's re-plans,
computed from the same plan and the same dead on each, agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

Hook = Callable[[int, str], Any]
"""``hook(step, phase)``: called at each phase point of a step (fault injection)."""


class Membership(Protocol):
    """One generation's membership, as the coordinator decided it."""

    @property
    def generation(self) -> int: ...
    @property
    def members(self) -> tuple[int, ...]: ...
    @property
    def step(self) -> int:
        """The first step the generation runs (the coordinator's last committed step + 1)."""
        ...

    @property
    def speeds(self) -> dict[int, float] | None:
        """The planned seconds per microbatch when the generation formed (a joiner's first plan)."""
        ...

    @property
    def joined(self) -> tuple[int, ...]:
        """Members admitted in this generation (they receive the state)."""
        ...

    @property
    def resync(self) -> bool:
        """Formed by a restarted coordinator: the ``joined`` members are behind and take the state first."""
        ...

    @property
    def restore(self) -> bool:
        """Nobody holds the state (every replica that did was lost): the members load the newest checkpoint."""
        ...


class Reduction(Protocol):
    """An all-reduce in flight (:mod:`recover.comm.reduction`)."""

    def final(self, i: int) -> None: ...

    def result(self) -> list[Tensor]: ...


class Group(Protocol):
    """Collectives over the members of one generation."""

    @property
    def generation(self) -> int: ...
    @property
    def members(self) -> tuple[int, ...]: ...
    @property
    def rank(self) -> int: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def device(self) -> torch.device:
        """Where collective buffers live (state transfer)."""
        ...

    def allreduce(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """SUM over members of each tensor, as new tensors."""
        ...

    def reduction(self, tensors: Sequence[Tensor], order: Sequence[int] | None = None) -> Reduction:
        """The same sum, its buckets launched as the caller marks tensors final (see
        :mod:`recover.comm.reduction`; a group may launch everything in ``result()``)."""
        ...

    def release(self, results: Sequence[Tensor]) -> None:
        """The caller is done with ``results`` of a collective and every view of them: the group may reuse
        their memory (a group that lends none ignores this)."""
        ...

    passed: tuple[Membership, ...]
    """Generations formed by others while this member's rendezvous failed, at its step (read once, then
    cleared by the step protocol)."""

    def barrier(self) -> None: ...

    def broadcast_into(self, buffers: Sequence[Tensor], src_rank: int) -> None: ...

    def next_generation(self) -> Group: ...

    def close(self) -> None: ...


class Coordinator(Protocol):
    """The commit vote."""

    speeds: dict[int, float] | None
    """Seconds per microbatch by replica to plan the next step with, as of the last commit (None: even)."""
    stopping: bool
    """The last commit was a stop: every member stops after that step (SIGINT to a worker, or the job's stop)."""
    left: bool
    """The last commit was this replica's leave (SIGTERM to it): it stops after that step, the others go on."""
    committed_step: int
    """The last step this replica holds committed (set after a resume or a state transfer)."""

    def vote_commit(self, generation: int, step: int, ids: list[int] | tuple[int, ...], *,
                    mb_s: float | None = None, fp: str | None = None,
                    audit: dict[str, Any] | None = None, comp_s: float | None = None,
                    comm_s: float | None = None) -> Membership | None:
        """``mb_s``: the seconds per microbatch this replica measured in the step (None: it computed none);
        ``comp_s`` and ``comm_s``: its wall seconds of compute and of waiting in the reduction (the slow-link
        rule, :mod:`recover.coord.graylinks`);
        ``fp``: the fingerprint of its parameters (None: not this step); ``audit``: its value of the
        step's audited microbatch, when it computed it.
        Returns None: committed. A membership: committed, and joiners are admitted in that new generation.
        Raises PeerFailure: a member died or the votes disagreed; nothing was committed."""
        ...

    def report_nonfinite(self, generation: int, step: int, ids: list[int]) -> None:
        """Microbatches ``ids`` were not finite on this replica (see ``ResilientStep.report_nonfinite``)."""
        ...

    def wait_for_generation(self, after: int, timeout: float) -> Membership:
        """Blocks until a generation after ``after`` exists (raises when this replica is not in it)."""
        ...


@dataclass(frozen=True)
class Totals:
    """What a step's reduced payload holds, as one host read gives it (:meth:`StepReplica.totals`)."""

    loss_sum: float
    microbatches: int
    sum_norm: float
    """L2 norm of the reduced gradient SUM over the whole replica (the step's norm is this / divisor)."""
    fingerprint: str | None = None
    """This replica's parameter fingerprint, when it was asked for."""


class StepReplica(Protocol):
    """One replica's share of a step (see :class:`~recover.train.replicas.replica.Replica` for the contract).

    Every member the step protocol uses is named here (a type checker holds each implementation to it)."""

    upcoming: Callable[[int], list[int]] | None
    """Set by the step protocol to its :meth:`~recover.recovery.protocol.ResilientStep.share`: the ids this
    replica expects in a coming step (a replica that reads its data ahead asks it; others ignore it)."""
    audit_id: int | None
    """The audited microbatch of this step when this replica owns it (set by the step protocol)."""
    audit_value: dict[str, Any] | None
    """The owner's fingerprint of the audited microbatch's gradient, once computed (None: none)."""

    @property
    def audits(self) -> bool:
        """Whether this replica can take part in audits (a microbatch's gradient is its own, unmixed)."""
        ...

    def audit(self, step: int, mb: int) -> dict[str, Any]:
        """Computes microbatch ``mb`` of ``step`` again, on its own: its gradient's fingerprint."""
        ...

    @property
    def tokens_per_microbatch(self) -> int: ...

    def reset(self) -> None: ...

    def compute(self, step: int, ids: list[int], hook: Hook, final: Callable[[int], None] | None = None) -> None:
        """``final(i)``: payload tensor ``i`` (a gradient buffer) is complete for this call."""
        ...

    def payload(self) -> list[Tensor]:
        """The same tensors all step (reduced on copies)."""
        ...

    @property
    def reduce_order(self) -> list[int] | None:
        """Payload indices in the order they become final (None: index order)."""
        ...

    def totals(self, reduced: list[Tensor], fingerprint: bool = False) -> Totals:
        """What the reduced payload holds, read to the host at once (with this replica's parameter
        fingerprint when ``fingerprint``): the one host synchronisation after the reduction."""
        ...

    def apply(self, reduced: list[Tensor], divisor: int, step: int, sum_norm: float) -> float:
        """The optimizer update from the reduced sum (consumed) and its norm (from :meth:`totals`)."""
        ...

    @property
    def nonfinite(self) -> list[int]:
        """Ids of this step whose loss or gradient was not finite here (not in the buffers)."""
        ...


    def transfer_state(self, counters: dict[str, int]) -> dict[str, Tensor]: ...

    def load_transfer_state(self, state: dict[str, Tensor]) -> dict[str, int]: ...
