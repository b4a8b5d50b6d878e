"""Names shared by several layers, from one source: step phases, baselines and config choices.

Contract: every other module (fault injection, the step protocol, the launcher's flags and help
texts, error messages, config choices) takes these names from here; nothing spells them out again.
Phases and baselines are ``str`` enums, so a member compares equal to its plain name
(``Phase.REDUCE == "reduce"``) and JSON logs keep writing plain strings; each member carries a
one-line ``help``. The config's choice fields are ``Literal`` types: the config checks a value
against the type's arguments, so the allowed values and the error message come from the type.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, get_args


class _Named(str, Enum):
    """A ``str`` enum whose members are ``NAME = "value", "one-line help"``."""

    help: str

    def __new__(cls, value: str, help: str = "") -> _Named:
        member = str.__new__(cls, value)
        member._value_ = value
        member.help = help
        return member

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def describe(cls) -> str:
        """``"value (help), ..."`` of every member: for help texts."""
        return ", ".join(f"{m.value} ({m.help})" for m in cls)


class Phase(_Named):
    """Points of a step at which a fault can be injected, in step order."""

    FORWARD = "forward", "while the step's microbatches run forward; the default"
    BACKWARD = "backward", "while they run backward"
    REDUCE = "reduce", "while the cross-replica reduction is in flight"
    COMMIT = "commit", "at the commit vote"
    OPTIMIZER = "optimizer", "after the commit, at the optimizer step"
    IDLE = "idle", "after the step, before the next one begins"
    RECOVER = "recover", "while recovering from another replica's failure"


PHASES: tuple[str, ...] = Phase.values()
STEP_PHASES: tuple[str, ...] = tuple(p.value for p in Phase if p is not Phase.RECOVER)
"""The phases every step passes through (``recover`` happens only when another replica fails)."""


class Baseline(_Named):
    """What a job runs instead of recover's in-step recovery, for comparison on the same failures."""

    SHRINK = "shrink", "shrink-and-drop, torchft's semantics: a failed step is dropped, the batch shrinks"
    RESTART = "restart", "checkpoint-and-restart: a failure stops the job, relaunched from the last checkpoint"


BASELINES: tuple[str, ...] = Baseline.values()


# ---- config choices (recover.config checks values against these types) --------------------------
Backend = Literal["auto", "gloo", "nccl"]
"""Collective backend: ``auto`` (NCCL on GPU, gloo on CPU), ``gloo`` or ``nccl``."""
Schedule = Literal["1f1b", "gpipe"]
"""Pipeline schedule: ``1f1b`` (GPipe for a quota below ``pp``) or ``gpipe``."""
Assignment = Literal["blocks", "strided", "shuffled"]
"""Failure-free ids -> replicas: contiguous blocks, strided, or shuffled by (seed, step)."""
Policy = Literal["weighted", "even"]
"""Workload policy: quotas weighted by the replicas' measured speeds (stragglers get fewer) or even."""
Dtype = Literal["float32", "bfloat16"]
"""Compute dtype (``training.dtype``); master weights, optimizer state and reductions stay float32."""
CompileBackend = Literal["inductor", "aot_eager"]
"""``training.compile_backend``: generated kernels, or a trace run eagerly (debugging, CPU tests)."""
Overlap = Literal["auto", "on", "off"]
"""``fault_tolerance.overlap_reduction``: ``auto`` overlaps on GPUs only."""
Connections = Literal["replica", "rank"]
"""Coordinator connections of a replica of several ranks: one through its relay (rank 0 runs it,
heartbeats batched: :mod:`recover.coord.relay`), or one per rank."""
ShardFormat = Literal["auto", "llmc", "nanogpt"]
"""Token shard format: ``auto`` (from the header), ``llmc`` (256 x int32 header) or ``nanogpt``."""
WandbMode = Literal["off", "offline", "online"]
"""``observe.wandb``: no Weights & Biases runs, runs kept on disk (``wandb sync`` uploads them), or uploaded live."""

BACKENDS: tuple[str, ...] = get_args(Backend)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
ASSIGNMENTS: tuple[str, ...] = get_args(Assignment)
SHARD_FORMATS: tuple[str, ...] = get_args(ShardFormat)


class Event(str, Enum):
    """The kind of every record of ``events.jsonl`` (its ``kind``): one member each, shared by the writers
    (coordinator, replicas, launcher) and the readers (reports, goodput, benchmarks), which match members,
    never literals. A ``str`` enum: the JSON lines hold the same plain names as ever, so run directories of
    any version read alike (``record["kind"] == Event.KILL``).
    """

    AUDIT = "audit"
    BARREN_REPORTS = "barren_reports"
    BAD_DATA = "bad_data"
    BAD_DATA_STOP = "bad_data_stop"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_ABANDONED = "checkpoint_abandoned"
    CHECKPOINT_FINAL = "checkpoint_final"
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_TIMEOUT = "checkpoint_timeout"
    CHECKPOINT_UNSAVED = "checkpoint_unsaved"
    COMMIT = "commit"
    COORDINATOR_CUT_OFF = "coordinator_cut_off"
    COORDINATOR_EXIT = "coordinator_exit"
    COORDINATOR_ISOLATED = "coordinator_isolated"
    COORDINATOR_KILLED = "coordinator_killed"
    COORDINATOR_LOST = "coordinator_lost"
    COORDINATOR_REACHED = "coordinator_reached"
    COORDINATOR_RECONNECTED = "coordinator_reconnected"
    COORDINATOR_STALLED = "coordinator_stalled"
    COORDINATOR_START = "coordinator_start"
    COORDINATOR_STOP = "coordinator_stop"
    COORDINATOR_ENDED = "coordinator_ended"
    COORDINATOR_FAILED = "coordinator_failed"
    DIVERGED = "diverged"
    DRAIN_REQUESTED = "drain_requested"
    DRAINED = "drained"
    DIVERGED_STOP = "diverged_stop"
    DIVERGENT = "divergent"
    END = "end"
    FAILING = "failing"
    FAILURE_DETECTED = "failure_detected"
    FAILURE_REPORT = "failure_report"
    FENCED = "fenced"
    FENCED_EXIT = "fenced_exit"
    FINISHED = "finished"
    FORK_SERVER = "fork_server"
    GENERATION = "generation"
    GREW = "grew"
    INJECTED = "injected"
    JOB_FAILED = "job_failed"
    JOB_RESTART = "job_restart"
    JOIN_HELD = "join_held"
    JOIN_REFUSED = "join_refused"
    JOIN_REQUEST = "join_request"
    KILL = "kill"
    LAUNCH = "launch"
    LEAVE = "leave"
    LEAVE_SIGNAL = "leave_signal"
    LEFT = "left"
    LINK_CUT = "link_cut"
    LINK_REPORT = "link_report"
    LINK_RESTORED = "link_restored"
    NONFINITE = "nonfinite"
    NONFINITE_DIVERGENCE = "nonfinite_divergence"
    NONFINITE_STOP = "nonfinite_stop"
    QUORUM_LOST = "quorum_lost"
    QUORUM_REFORMED = "quorum_reformed"
    RANK_REGISTER = "rank_register"
    RANK_VOTE_DISAGREEMENT = "rank_vote_disagreement"
    REAPED = "reaped"
    REBALANCED = "rebalanced"
    REBUILT = "rebuilt"
    RECOVERED = "recovered"
    RECOVERY = "recovery"
    REFUSED = "refused"
    REGISTER = "register"
    REGISTER_ABANDONED = "register_abandoned"
    REJOIN_STARTED = "rejoin_started"
    REPLICA_EXIT = "replica_exit"
    REPLICA_GIVEN_UP = "replica_given_up"
    RESTORED = "restored"
    RESYNCED = "resynced"
    RUN_DIR_RECREATED = "run_dir_recreated"
    SCRIPT_ERROR = "script_error"
    SCRIPT_ERROR_STOP = "script_error_stop"
    SCRIPT_STEPS = "script_steps"
    SLOWED = "slowed"
    SLOW_LINK = "slow_link"
    SLOW_LINK_CLEARED = "slow_link_cleared"
    SLOW_LINK_HELD = "slow_link_held"
    SLOW_LINK_PROBE = "slow_link_probe"
    SPARE_EXIT = "spare_exit"
    START_FAILED = "start_failed"
    START_TIMEOUT = "start_timeout"
    STARTED = "started"
    STATE_RECEIVED = "state_received"
    STEP_DROPPED = "step_dropped"
    STEP_KEPT = "step_kept"
    STOP = "stop"
    STOP_GRACE_OVER = "stop_grace_over"
    EXIT_GRACE_OVER = "exit_grace_over"
    STOP_REQUESTED = "stop_requested"
    STOP_SIGNAL = "stop_signal"
    STOPPED = "stopped"
    STRAGGLER = "straggler"
    STRAGGLER_CLEARED = "straggler_cleared"
    TRAIN_START = "train_start"
    VOTE_DISAGREEMENT = "vote_disagreement"

    def __str__(self) -> str:
        return str(self.value)



def slowing(event: dict[str, Any]) -> bool:
    """Whether an ``events.jsonl`` record starts (or changes) a slow-down: a ``slowed`` event with a factor
    above 1 (factor 1 ends it). The one rule for the slow fault kind that writes it and the readers that
    measure its span (goodput)."""
    return event.get("kind") == Event.SLOWED and float(event.get("factor", 1.0)) > 1.0

WORKER_ENV = "RECOVER_WORKER"
"""Set by ``recover launch ... -- CMD`` in each replica's process, as JSON: ``coordinator`` (HOST:PORT),
``token_file``, ``out`` (the run directory), ``replica``, ``fail`` (its fault specs ``R@STEP:PHASE[=FAULT]``)
and ``join`` (it joins a running job); ``tls`` (``cert``, ``key``, ``ca``) when the coordinator wire is TLS
(:mod:`recover.coord.tls`). A cluster recipe (``SCRIPT=...``) sets it too, with ``config`` (a preset or
``.toml``) and ``overrides`` in place of the run's ``config.json``, and ``resume``. :func:`recover.api.init`
reads it."""
