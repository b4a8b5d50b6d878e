"""When the saving replica checkpoints: every K committed steps, or K chosen by Young/Daly as the job runs.

``training.checkpoint_every = K`` (K > 0) saves after every K-th committed step and after the last one;
0 saves none of these (only the saves of an early end: a stop, too few replicas, the coordinator lost);
``"auto"`` chooses K by Young/Daly's first-order optimum (:func:`young_daly_steps`)::

    K = round(sqrt(2 C MTBF) / T) steps, at least 1

- C: the seconds a save blocked training, as the loop waited for it (an asynchronous save's staging
  and any wait for the one before, not its background write): the median of the saver's last
  :data:`COSTS`. The saver's first save comes after its first committed step, to measure C.
- MTBF: the configured one (``fault_tolerance.mtbf_s``; 0, the default: :func:`default_mtbf_s`) taken as
  the prior worth one failure, updated with the failures this replica saw in its committed steps over
  its training time: ``(prior + elapsed) / (1 + failures)`` (:meth:`Cadence.mtbf_s`): the prior at the
  start, the observed rate once failures outweigh it.
- T: the median time of the last :data:`STEPS` committed steps this replica measured.

Contract: only the lowest live replica saves, so its cadence decides alone; every replica feeds its own
(:meth:`Cadence.stepped`), so one that takes over from a lost saver knows T and the failures, and saves
after its first step as saver to measure C for itself (a fresh checkpoint just after a failure is worth
having). K is chosen again after each save and after each step that saw failures; the caller logs it
(``checkpoint_interval``) when it changes. In a replica of several ranks every rank must decide alike
(the save is collective there): the caller shares rank 0's K (:meth:`recover.train.replicas.replica.Replica.agreed`).
Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from recover.config import AUTO, Config
from recover.errors import ConfigError

GPU_MTBF_H = 50_000.0
"""Mean time between failures of one GPU with its share of host, network and software, in hours: the
pre-training of Llama 3 405B met 419 unexpected interruptions in 54 days on 16,384 GPUs (Meta, "The Llama 3
Herd of Models", 2024: 16,384 x 54 x 24 / 419 = 50,700 GPU-hours each). The simulator's
``JobSpec.gpu_mttf_h`` uses the same figure."""
COSTS = 5
"""Save costs the median of C is taken over (the first save, which also describes the run, costs more)."""
STEPS = 100
"""Step times the median of T is taken over."""


def default_mtbf_s(processes: int) -> float:
    """The job's MTBF when none is configured: :data:`GPU_MTBF_H` shared by its processes (one per GPU):
    about 3 hours for 16,384 processes, 12,500 hours for 4."""
    return GPU_MTBF_H * 3600.0 / max(1, processes)


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimal compute time between checkpoints, ``sqrt(2 C MTBF)`` seconds."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def young_daly_steps(save_cost_s: float, mtbf_s: float, step_time_s: float) -> int:
    """Checkpoint interval in steps by Young/Daly: ``max(1, round(sqrt(2 C MTBF) / step_time))``.

    Raises:
        ConfigError: a cost, MTBF or step time that is not finite and > 0 (cost may be 0).
    """
    if not (math.isfinite(save_cost_s) and save_cost_s >= 0):
        raise ConfigError(f"save cost {save_cost_s!r} s must be finite and >= 0")
    for name, value in (("MTBF", mtbf_s), ("step time", step_time_s)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} {value!r} s must be finite and > 0")
    return max(1, round(young_daly_interval_s(save_cost_s, mtbf_s) / step_time_s))


class Cadence:
    """Which committed steps the saver checkpoints after (see the module docstring).

    Args:
        every: ``training.checkpoint_every``: steps between saves (0: none but the early ends') or ``"auto"``.
        prior_mtbf_s: the MTBF assumed before any failure is seen (``"auto"`` only).
    """

    def __init__(self, every: int | str, prior_mtbf_s: float) -> None:
        self.auto = every == AUTO
        self.every = 0 if self.auto else int(every)
        """K: steps between saves (``"auto"``: 0 until the first save measured C)."""
        self.prior_mtbf_s = prior_mtbf_s
        self.step_times: deque[float] = deque(maxlen=STEPS)
        self.save_costs: deque[float] = deque(maxlen=COSTS)
        self.failures = 0
        self.elapsed_s = 0.0
        self.saved_at: int | None = None
        """Committed steps at this replica's last periodic save (None: it has not saved)."""

    @classmethod
    def of(cls, cfg: Config) -> Cadence:
        """The cadence of ``cfg``'s job (``training.checkpoint_every``, ``fault_tolerance.mtbf_s``)."""
        p = cfg.parallel
        prior = cfg.fault_tolerance.mtbf_s or default_mtbf_s(p.replicas * p.procs_per_replica)
        return cls(cfg.training.checkpoint_every, prior)

    def stepped(self, seconds: float, failures: int) -> None:
        """A committed step took ``seconds`` and saw ``failures`` replicas lost (every replica calls it)."""
        self.step_times.append(seconds)
        self.elapsed_s += seconds
        self.failures += failures

    def periodic(self) -> bool:
        """Whether the saver checkpoints before the job's end (``training.checkpoint_every`` set)."""
        return self.auto or self.every > 0

    def due(self, step: int, end: int) -> bool:
        """Whether the saver checkpoints after (0-based) ``step`` of a run of ``end`` steps."""
        done = step + 1
        if done == end:
            return self.auto or self.every > 0
        if self.auto:
            return self.saved_at is None or done - self.saved_at >= self.every
        return self.every > 0 and done % self.every == 0

    def saved(self, committed: int, blocking_s: float) -> None:
        """The saver checkpointed ``committed`` steps, or tried to (a save the storage refused counts: it
        is not tried again at once); training waited ``blocking_s`` for it."""
        self.saved_at = committed
        self.save_costs.append(blocking_s)

    def mtbf_s(self) -> float:
        """The MTBF estimate: the prior counted as one failure, plus the failures seen over the time trained."""
        return (self.prior_mtbf_s + self.elapsed_s) / (1 + self.failures)

    def choose(self) -> int:
        """Young/Daly's K from the measurements so far (``"auto"`` after a save; the fixed K otherwise)."""
        if not self.auto or not self.save_costs or not self.step_times:
            return self.every
        step_s = max(statistics.median(self.step_times), 1e-9)
        return young_daly_steps(statistics.median(self.save_costs), self.mtbf_s(), step_s)

    def set(self, every: int) -> bool:
        """Takes K (as chosen, or as the replica's rank 0 chose it); returns whether it changed."""
        changed, self.every = every != self.every, every
        return changed

    def describe(self) -> dict[str, float | int]:
        """The fields of a ``checkpoint_interval`` event: K and what it was chosen from."""
        return {"every": self.every, "save_cost_s": round(statistics.median(self.save_costs), 6),
                "mtbf_s": round(self.mtbf_s(), 3), "step_time_s": round(statistics.median(self.step_times), 6),
                "failures": self.failures}
