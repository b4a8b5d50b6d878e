"""Typed, frozen configuration: dataclasses, TOML presets and dotted command-line overrides.

Contract:
- A :class:`Config` is immutable and valid once constructed: every section checks its fields in
  ``__post_init__`` and :class:`Config` checks the relations between sections, including every
  layout constraint of the replica (:func:`check_layout`: the architecture's own rules, for Llama
  heads, kv heads and MLP width by ``tp``; layers and tied embeddings by ``pp`` for every one). This
  is the one place these rules are called from: ``recover launch`` refuses a bad job before it starts
  anything, and :meth:`recover.parallel.ParallelDims.check_model` calls :func:`check_layout` too.
- ``model.arch`` names a registered architecture (:mod:`recover.model.spec`, which imports no
  torch); a config written before ``arch`` existed reads as ``llama``, the default.
- Choice fields are ``Literal`` types from :mod:`recover.names`; a value is checked against the
  type's arguments, so the allowed values and the message come from the type.
- Every problem is a :class:`~recover.errors.ConfigError` with a one-line message naming the
  field, the value given and what is allowed (and, for a misspelt key, the closest known key).
- Presets are TOML files (``configs/NAME.toml``); overrides are ``--section.field VALUE`` or
  ``--section.field=VALUE`` and are applied on top of the preset, with the field's type.
- A run's ``config.json`` (the whole, resolved config ``recover launch`` writes into the run directory,
  :func:`write_run_config`) loads like a preset (:data:`RUN_CONFIG`): its workers read it, not the
  preset and overrides again. A ``.json`` that is not one is refused in one line naming the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from recover.errors import ConfigError, check_numbers, require
from recover.model import spec as model_spec
from recover.model.spec import ModelConfig
from recover.names import (
    Assignment,
    Backend,
    CompileBackend,
    Connections,
    Dtype,
    Overlap,
    Policy,
    Schedule,
    ShardFormat,
    WandbMode,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


AUTO = "auto"
MAX_MICROBATCHES = 2**20
"""The most microbatches a step may hold (``training.global_microbatches``): every step's ids are planned,
voted on and recorded by every replica."""
STEP_MEMORY_SHARE = 0.5
"""The share of this machine's memory one step's tokens may take (:func:`step_bytes`)."""
"""The value of a field chosen as the job runs (``training.checkpoint_every``)."""


def _choice_error(name: str, value: Any, choices: tuple[Any, ...]) -> ConfigError:
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{name} = {value!r} is not allowed: one of {', '.join(map(repr, choices))}{hint}")


def _check_choices(section: Any) -> None:
    """Checks every ``Literal`` field of a section dataclass against the type's arguments, and every numeric
    field's range (:func:`~recover.errors.check_numbers`: finite, 64 bits, durations bounded)."""
    check_numbers(section, section.SECTION)
    for fname, typ in _field_types(type(section)).items():
        if typing.get_origin(typ) is Literal:
            value, choices = getattr(section, fname), typing.get_args(typ)
            if not any(type(value) is type(c) and value == c for c in choices):
                raise _choice_error(f"{section.SECTION}.{fname}", value, choices)


@dataclass(frozen=True)
class DataSource:
    """One source of a mixture: a data directory (anything ``data.path`` takes) and its weight."""

    path: str
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how a microbatch is cut."""

    SECTION: ClassVar[str] = "data"

    path: str = "builtin:stdlib"
    """A directory of token shards: ``recover prepare``'s, nanoGPT's (``train.bin``, ``val.bin``, ``meta.pkl``)
    or llm.c's (``*_train*.bin``, ``*_val*.bin``), told apart by the files present; or ``builtin:stdlib``
    (prepared on demand)."""
    cache_dir: str = "data"
    """Where ``builtin:`` corpora are prepared."""
    train_pattern: str = ""
    """Glob of training shards inside ``path``; empty: detected from the files present
    (``train_*.bin``, ``train.bin`` or ``*_train*.bin``)."""
    val_pattern: str = ""
    """Glob of validation shards inside ``path``; empty: detected (``val_*.bin``, ``val.bin`` or ``*_val*.bin``)."""
    format: ShardFormat = "auto"
    """Shard format: ``auto``, ``llmc`` (256 x int32 header) or ``nanogpt`` (raw uint16)."""
    seq_len: int = 128
    """Tokens per sequence."""
    microbatch_size: int = 4
    """Sequences per microbatch; one microbatch is the unit of work a replica is assigned."""
    sources: tuple[DataSource, ...] = ()
    """A weighted mixture instead of ``path``: TOML ``sources = [{path = "web", weight = 0.7}, {path = "code",
    weight = 0.3}]``, command line ``--data.sources web=0.7,code=0.3``. Each source is a directory as ``path``
    takes (the same tokenizer for all; the patterns and format apply to each) with its own epochs; the rows
    of every microbatch are split among them by the weights (:mod:`recover.data.mixture`), and validation
    reads every source's validation split."""
    prefetch: int = 2
    """Steps of look-ahead: a replica reads its microbatches of the current step and its expected share of
    this many coming steps in a background thread (:mod:`recover.data.prefetch`); 0 reads each on the
    training thread when it is computed."""

    def __post_init__(self) -> None:
        _check_choices(self)
        require(isinstance(self.seq_len, int) and self.seq_len > 0, "data.seq_len", self.seq_len,
                 "a positive integer")
        require(isinstance(self.microbatch_size, int) and self.microbatch_size > 0,
                 "data.microbatch_size", self.microbatch_size, "a positive integer")
        require(isinstance(self.prefetch, int) and not isinstance(self.prefetch, bool) and self.prefetch >= 0,
                 "data.prefetch", self.prefetch, "an integer >= 0 (steps of look-ahead; 0: synchronous reads)")
        require(bool(self.path), "data.path", self.path, "a shard directory or 'builtin:stdlib'")
        for src in self.sources:
            require(isinstance(src, DataSource) and bool(src.path), "data.sources", self.sources,
                     "sources with a path each (path=WEIGHT,...)")
            require(isinstance(src.weight, (int, float)) and math.isfinite(src.weight) and src.weight > 0,
                     "data.sources", f"{src.path}={src.weight}", "a positive weight for every source")
        paths = [src.path for src in self.sources]
        require(len(set(paths)) == len(paths), "data.sources", ",".join(paths), "each path once")

    def parts(self) -> list[tuple[DataConfig, float]]:
        """Each source as a one-directory config with its weight; ``[(self, 1.0)]`` without ``sources``."""
        if not self.sources:
            return [(self, 1.0)]
        return [(dataclasses.replace(self, path=src.path, sources=()), float(src.weight)) for src in self.sources]


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation, schedule, evaluation and checkpointing."""

    SECTION: ClassVar[str] = "training"

    steps: int = 100
    """Committed optimizer steps to run."""
    global_microbatches: int = 8
    """M: microbatches in every committed step; the gradient is always divided by M."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to ``lr``."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seeds the initialisation and the data order."""
    eval_every: int = 25
    """Validation loss every this many steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Validation microbatches per evaluation."""
    checkpoint_every: int | Literal["auto"] = 0
    """Save a checkpoint every this many steps (and at the end when > 0); 0 disables. ``"auto"``: every K
    steps, K chosen as the job runs by Young/Daly from the measured cost of a save (what training waits
    for it), the median step time and the failures seen (prior: ``fault_tolerance.mtbf_s``), logged as
    ``checkpoint_interval`` when it changes (:mod:`recover.train.checkpoints.cadence`); the first save comes after the
    first step, to measure its cost, and the last step is saved too."""
    checkpoint_async: bool = True
    """Periodic checkpoints with ``torch.distributed.checkpoint.async_save`` (the default): the step blocks
    only while the state is copied to CPU memory; a background thread writes it, and it becomes visible
    (loadable) only once complete. At most one is in flight: one due while the previous is still being
    written is skipped and reported (``checkpoint_skipped``), never queued. The final save and the end of
    the run wait for it. False: every save blocks the step until written. A replica of several ranks
    (pp x fsdp x tp > 1) always saves synchronously."""
    checkpoint_timeout_s: float = 600.0
    """How long ``recover launch`` waits for the checkpoint a job ends with (the last step's, a stop's) once
    its write began, before it kills the replica writing it: the job then ends with status 12, naming the
    newest complete checkpoint (the exit grace, ``fault_tolerance.stop_grace_s``, never cuts a save short)."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept: after each save the older ones beyond this many are deleted (a resume
    falls back to an older one when the newest is damaged). 0 keeps them all."""
    threads: int = 0
    """torch intra-op threads per process; 0 means ``OMP_NUM_THREADS`` where set, else cores / local processes."""
    deterministic: bool = False
    """Accumulate and reduce gradients in float64 so a step does not depend on who computed what, and use
    deterministic kernels (``torch.use_deterministic_algorithms``; on CUDA also
    ``CUBLAS_WORKSPACE_CONFIG``; inductor does not autotune): a run with faults is then bitwise equal to
    its failure-free run for one-process, tensor-parallel, FSDP (FSDP2 reduce-scatters each pass in
    float64) and pipeline replicas (a stage folds each microbatch's gradient on its own), on the same
    hardware and software (every replica on the same GPU model; exact audits compare fingerprints).
    Slower on GPUs (deterministic attention backward)."""
    dtype: Dtype = "float32"
    """Compute dtype: ``bfloat16`` runs forward and backward under autocast (matmuls in bf16) while the
    master weights, the optimizer state, the accumulation over microbatches and the cross-replica
    reduction stay float32 (float64 in deterministic mode)."""
    compile: bool = False
    """``torch.compile`` each transformer block (inductor; on CPU it needs a C++ compiler). Each replica
    compiles before it joins, in one warm-up pass (seconds to minutes by model size), so a replacement
    never makes the others wait on its compiler. In deterministic mode inductor picks kernels without
    on-device benchmarks, so every replica runs the same kernels and deterministic mode stays bitwise;
    outside it replicas may autotune to different kernels (their parameters still agree: the update
    is the same elementwise arithmetic on the same reduced gradient)."""
    compile_backend: CompileBackend = "inductor"
    """The ``torch.compile`` backend when ``compile`` is on: ``inductor`` (generated kernels), or
    ``aot_eager`` (traced, no code generation: for debugging and CPU tests)."""
    assignment: Assignment = "blocks"
    """Failure-free ids -> replicas: ``blocks``, ``strided`` or ``shuffled`` (the trajectory is the same)."""
    device_time_s: float = 0.0
    """Emulated device: every microbatch takes at least this much wall time (its real compute, then a
    sleep for the rest), so replicas sharing a few CPU cores behave like dedicated accelerators in
    benchmarks and tests (a step takes its quota's time; a lost replica's work costs the survivors).
    0: off."""
    init_from: str = ""
    """Start from these weights instead of the seeded initialisation (``--init-from``): a recover run or
    checkpoint directory, a Hugging Face Llama directory, or a ``recover export --format torch`` file.
    Step 0 and a fresh optimizer; the shapes must match the model. Empty: the seeded initialisation."""

    def __post_init__(self) -> None:
        _check_choices(self)
        for name in ("steps", "global_microbatches", "eval_batches"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"training.{name}", value, "a positive integer")
        for name in ("warmup_steps", "eval_every", "threads", "seed", "keep_checkpoints"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"training.{name}", value,
                     "a non-negative integer")
        every = self.checkpoint_every
        require(every == AUTO or (isinstance(every, int) and not isinstance(every, bool) and every >= 0),
                 "training.checkpoint_every", every, f"an integer >= 0 (steps between saves; 0: none) or {AUTO!r} "
                 "(Young/Daly)")
        require(self.lr > 0, "training.lr", self.lr, "a positive number")
        require(0 <= self.min_lr <= self.lr, "training.min_lr", self.min_lr,
                 f"between 0 and training.lr = {self.lr}")
        require(self.weight_decay >= 0, "training.weight_decay", self.weight_decay, "a number >= 0")
        require(0 <= self.beta1 < 1, "training.beta1", self.beta1, "a number in [0, 1)")
        require(0 <= self.beta2 < 1, "training.beta2", self.beta2, "a number in [0, 1)")
        require(self.grad_clip >= 0, "training.grad_clip", self.grad_clip, "a number >= 0 (0 disables)")
        require(self.device_time_s >= 0, "training.device_time_s", self.device_time_s,
                 "a number of seconds >= 0 (0: off)")
        require(self.checkpoint_timeout_s > 0, "training.checkpoint_timeout_s", self.checkpoint_timeout_s,
                 "a positive number of seconds")
        require(self.warmup_steps <= self.steps, "training.warmup_steps", self.warmup_steps,
                 f"at most training.steps = {self.steps}")

    def eval_due(self, step: int, end: int | None = None) -> bool:
        """Whether validation runs after (0-based) ``step``: every ``eval_every`` steps and at the end."""
        last = step + 1 == (end or self.steps)
        return bool(self.eval_every and (step + 1) % self.eval_every == 0) or last


@dataclass(frozen=True)
class ParallelConfig:
    """How many replicas, and how the ranks inside one replica split the model."""

    SECTION: ClassVar[str] = "parallel"

    replicas: int = 1
    """Data-parallel replicas (the failure unit); the fault-tolerant axis across them is layer 1's."""
    pp: int = 1
    """Pipeline stages inside a replica."""
    tp: int = 1
    """Tensor-parallel degree inside a replica."""
    fsdp: int = 1
    """FSDP2 shard degree inside a replica (HSDP when replicas > 1)."""
    backend: Backend = "auto"
    """Collective backend: ``auto`` (NCCL on GPU, gloo on CPU), ``gloo`` or ``nccl``."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule when ``pp > 1``: ``1f1b`` (GPipe for a quota below ``pp``) or ``gpipe``."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (inside a replica of several ranks)."""
    sequence_parallel: bool = False
    """Sequence-parallel norms and residual stream (needs ``tp > 1`` and ``pp = 1``)."""

    def __post_init__(self) -> None:
        for name in ("replicas", "pp", "tp", "fsdp"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"parallel.{name}", value, "a positive integer")
        _check_choices(self)
        require(not self.sequence_parallel or (self.tp > 1 and self.pp == 1), "parallel.sequence_parallel",
                 self.sequence_parallel, f"false unless parallel.tp > 1 and parallel.pp = 1 (tp = {self.tp}, "
                 f"pp = {self.pp})")

    @property
    def procs_per_replica(self) -> int:
        """Processes in one replica: ``pp * tp * fsdp``."""
        return self.pp * self.tp * self.fsdp


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Failure detection and recovery limits."""

    SECTION: ClassVar[str] = "fault_tolerance"

    min_replicas: int = 1
    """Below this many live replicas the job saves a checkpoint and stops."""
    heartbeat_interval_s: float = 0.1
    """How often a worker tells the coordinator it is alive, at least: the coordinator raises it for
    large jobs so that its heartbeat load stays bounded (:mod:`recover.coord.scale`); crashes are seen
    from closed connections at once, whatever the interval."""
    heartbeat_timeout_s: float = 1.0
    """Silence after which a worker counts as frozen (SIGSTOP, livelock)."""
    collective_timeout_s: float = 60.0
    """Backend timeout of a generation's process group (a last resort: failures end waits first)."""
    intra_replica_timeout_s: float = 30.0
    """Backend timeout of the groups inside a replica (pipeline sends, TP and FSDP collectives)."""
    hang_timeout_s: float = 0.0
    """A replica whose training loop makes no progress for this long while others wait for it is fenced
    as hung (its process and heartbeats may be alive: a stuck kernel, a deadlocked loader). 0: derived
    from the measured step time, max(60 s, 10 x the median step)."""
    connections: Connections = "replica"
    """A replica of several ranks reaches the coordinator through one connection (``replica``: rank 0
    runs a relay that batches its ranks' heartbeats, :mod:`recover.coord.relay`) or one per rank
    (``rank``). Either way any rank's death or silence fences the whole replica."""
    fence_exit_s: float = 1.0
    """A fenced process that has not exited this long after the coordinator told it is ended by its own
    watchdog (its training thread may be stuck) and, failing that, SIGKILLed by the launcher."""
    coordinator_reconnect_s: float = 30.0
    """How long workers that lost the coordinator keep their state and retry to reach it (``recover
    launch`` restarts it at once; across hosts, restart ``recover coordinator`` with the same flags).
    Past it, the lowest live replica saves a complete checkpoint and the job stops (exit status 7)."""
    overlap_reduction: Overlap = "auto"
    """Whether the cross-replica reduction of a one-process replica's last microbatch overlaps its
    backward: each gradient bucket is launched (on a copy) as soon as the backward has finished it, in
    reverse parameter order, as DDP does. ``auto``: on when the replica computes on a GPU (the host and
    the network are idle during its backward), off on CPUs, where the compute already occupies the
    cores that gloo would reduce on (measured: 4-11% slower on the 2-core VM, docs/BENCHMARKS.md)."""
    bucket_mb: float = 16.0
    """Size of the cross-replica all-reduce buckets in MiB (the first bucket of an overlapped reduction
    is at most 1 MiB, so communication starts early). Smaller buckets overlap more of the backward but
    launch more collectives."""
    fingerprint_every: int = 1
    """Every this many steps each replica votes with an exact fingerprint of its parameters (one read of
    them on its device) and a minority that differs is fenced before the step commits (silent data
    corruption). 0: never. Larger values cost less but let a corrupted replica's gradients into the
    committed steps until its next fingerprint, and a joiner may take its state meanwhile."""
    audit_every: int = 0
    """Every this many steps one microbatch, drawn from (seed, step), is computed by its owner and by the
    two replicas after it, and their gradients compared (exact fingerprints in deterministic mode,
    norms within 1e-5 otherwise): the odd one is fenced. Catches corrupted arithmetic, which parameter
    fingerprints cannot (every replica applies the same reduced gradient). Costs two extra microbatches
    per audit; one-process replicas only. 0: off."""
    mtbf_s: float = 0.0
    """The job's mean time between failures in seconds, as ``training.checkpoint_every = "auto"`` assumes it
    before failures are seen (then it counts as one failure's worth of evidence beside the observed ones).
    0: 50,000 GPU-hours shared by the job's processes (Llama 3 405B's published interruption rate; about 3 h
    for 16,384 GPUs: :func:`recover.train.checkpoints.cadence.default_mtbf_s`)."""
    start_timeout_s: float = 60.0
    """How long the first generation waits for every replica after the first registered: then it forms of
    those registered (at least ``min_replicas``), and the others join at a step boundary when they come."""
    stop_grace_s: float = 20.0
    """After SIGTERM or SIGINT, how long ``recover launch`` waits for the job to reach a step boundary,
    save a complete checkpoint and exit (exit status 6) before it kills every process."""
    slow_link_factor: float = 1.5
    """The slow-link rule's threshold (:mod:`recover.coord.graylinks`): a replica is fenced for its link (cause
    ``slow_link``) when the measured step exceeds this many times the step estimated without it (M microbatches
    over the others' measured rates plus the reduction at the slowest link left), after
    ``slow_link_steps`` communication-bound commits in a row and a timed probe of every pair of members; it is
    readmitted once its probe shows the step with it within this factor. 0: off."""
    slow_link_steps: int = 3
    """Commits in a row whose reduction exceeds ``(slow_link_factor - 1)`` x their compute before the members'
    links are probed (doubled after each probe that fences nobody, at most 64 x)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        require(isinstance(self.min_replicas, int) and self.min_replicas >= 1,
                 "fault_tolerance.min_replicas", self.min_replicas, "an integer >= 1")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s",
                     "intra_replica_timeout_s", "fence_exit_s", "coordinator_reconnect_s", "stop_grace_s",
                     "start_timeout_s"):
            value = getattr(self, name)
            require(value > 0, f"fault_tolerance.{name}", value, "a positive number of seconds")
        for name in ("fingerprint_every", "audit_every"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"fault_tolerance.{name}", value,
                     "an integer >= 0 (0: never)")
        require(isinstance(self.mtbf_s, (int, float)) and math.isfinite(self.mtbf_s) and self.mtbf_s >= 0,
                 "fault_tolerance.mtbf_s", self.mtbf_s, "a number of seconds >= 0 (0: from the job's size)")
        require(self.bucket_mb > 0, "fault_tolerance.bucket_mb", self.bucket_mb, "a positive number of MiB")
        require(self.slow_link_factor == 0 or self.slow_link_factor > 1, "fault_tolerance.slow_link_factor",
                self.slow_link_factor, "a number > 1 (0: off)")
        require(isinstance(self.slow_link_steps, int) and self.slow_link_steps >= 1, "fault_tolerance.slow_link_steps",
                self.slow_link_steps, "an integer >= 1")
        require(self.hang_timeout_s >= 0, "fault_tolerance.hang_timeout_s", self.hang_timeout_s,
                 "a number of seconds >= 0 (0: derived from the step time)")
        require(self.heartbeat_interval_s < self.heartbeat_timeout_s, "fault_tolerance.heartbeat_interval_s",
                 self.heartbeat_interval_s,
                 f"less than fault_tolerance.heartbeat_timeout_s = {self.heartbeat_timeout_s}")


    def overlaps(self, device_type: str) -> bool:
        """Whether a replica computing on ``device_type`` overlaps its reduction (``overlap_reduction``)."""
        return self.overlap_reduction == "on" or (self.overlap_reduction == "auto" and device_type == "cuda")


@dataclass(frozen=True)
class WorkloadConfig:
    """Which replica computes which microbatches (layer 3)."""

    SECTION: ClassVar[str] = "workload"

    policy: Policy = "weighted"
    """``weighted``: each step's quotas follow the replicas' measured seconds per microbatch, agreed at
    each commit (a slow replica gets fewer; noise moves nothing: see :mod:`recover.workload.speeds`).
    ``even``: quotas differ by at most one (a straggler slows every step). Either way every step
    holds the same M microbatches."""

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass(frozen=True)
class ObserveConfig:
    """Where the job's metrics go besides ``metrics.jsonl`` and ``events.jsonl`` (:mod:`recover.observe.sinks`)."""

    SECTION: ClassVar[str] = "observe"

    tensorboard: bool = False
    """TensorBoard event files under ``RUN_DIR/tensorboard/``: ``replica_R/`` from each replica (loss,
    tokens/s, step time, ...), ``job/`` from the coordinator (generation, members, goodput, faults)."""
    wandb: WandbMode = "off"
    """Weights & Biases: one run per replica, grouped by the run directory (``pip install
    'recover-llm[wandb]'``); ``offline`` keeps them under ``WANDB_DIR`` for ``wandb sync``."""
    wandb_project: str = "recover"
    """The W&B project of those runs."""
    plots: bool = True
    """``loss.png``, ``throughput.png`` and ``goodput.png`` drawn into the run directory when the job ends (about
    a second of CPU for matplotlib); false: none drawn then (``recover report RUN`` draws them any time)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        require(bool(self.wandb_project), "observe.wandb_project", self.wandb_project, "a non-empty project name")


@dataclass(frozen=True)
class Config:
    """The whole job."""

    name: str = "custom"
    """Preset name, for logs."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    def __post_init__(self) -> None:
        """Every constraint between sections, checked before anything starts."""
        m, p = self.training.global_microbatches, self.parallel
        check_layout(self.model, p.pp, p.tp)
        balanced = p.replicas * p.fsdp
        require(m >= balanced, "training.global_microbatches", m,
                 f"at least parallel.replicas x parallel.fsdp = {balanced}, so every rank has a microbatch "
                 "in the failure-free step")
        require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len", self.data.seq_len,
                 f"at most model.max_seq_len = {self.model.max_seq_len}")
        require(not p.sequence_parallel or self.data.seq_len % p.tp == 0, "data.seq_len", self.data.seq_len,
                 f"a multiple of parallel.tp = {p.tp} with parallel.sequence_parallel (the sequence is split "
                 "over the TP ranks)")
        require(self.fault_tolerance.min_replicas <= p.replicas, "fault_tolerance.min_replicas",
                 self.fault_tolerance.min_replicas, f"at most parallel.replicas = {p.replicas}")
        ranks = p.pp * p.tp * p.fsdp
        require(self.fault_tolerance.audit_every == 0 or ranks == 1, "fault_tolerance.audit_every",
                 self.fault_tolerance.audit_every,
                 f"0 with replicas of {ranks} ranks (pp x tp x fsdp): an audit recomputes one microbatch's "
                 "gradient on its own, which only a one-process replica has; fingerprints "
                 "(fault_tolerance.fingerprint_every) still catch a replica whose parameters went wrong")
        self._check_step_size()

    def _check_step_size(self) -> None:
        """What one step may hold: at most :data:`MAX_MICROBATCHES` ids, and its tokens within
        :data:`STEP_MEMORY_SHARE` of this machine's memory (:func:`step_bytes`)."""
        m, d = self.training.global_microbatches, self.data
        require(m <= MAX_MICROBATCHES, "training.global_microbatches", m,
                f"at most {MAX_MICROBATCHES:,} (every step's ids are planned and voted on): fewer, larger "
                "microbatches (data.microbatch_size)")
        need, have = step_bytes(self), memory_bytes()
        if have and need > STEP_MEMORY_SHARE * have:
            raise ConfigError(
                f"training.global_microbatches = {m} is not allowed with data.microbatch_size = {d.microbatch_size} "
                f"and data.seq_len = {d.seq_len}: a step of {m * d.microbatch_size * d.seq_len:,} tokens holds "
                f"{need / 2**30:.1f} GiB of token ids ({d.prefetch + 1} steps with data.prefetch = {d.prefetch}), "
                f"more than half of this machine's {have / 2**30:.1f} GiB: lower one of them")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, overrides: dict[str, Any]) -> Config:
        """A copy with ``{"section.field": value}`` overrides applied (values already typed)."""
        return from_dict(_merge(self.to_dict(), _nest(overrides)))


def step_bytes(cfg: Config) -> int:
    """The bytes of token ids one replica holds for a step when it computes all of it (the others lost):
    inputs and targets as int64 for every token of the step, for the step and ``data.prefetch`` coming ones."""
    d = cfg.data
    return cfg.training.global_microbatches * d.microbatch_size * d.seq_len * 16 * (d.prefetch + 1)


def memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def check_layout(model: ModelConfig, pp: int = 1, tp: int = 1) -> None:
    """Raises ConfigError unless ``model`` splits into ``pp`` pipeline stages and ``tp`` TP shards.

    The one implementation of the replica's layout rules (:class:`Config` and
    :meth:`recover.parallel.ParallelDims.check_model` both call it): first the architecture's own
    (:attr:`recover.model.spec.ModelSpec.validate`; Llama: ``tp`` divides the query heads, the kv
    heads and the SwiGLU width), then those of every architecture: ``pp`` is at most the number of
    blocks (every stage holds one); embeddings are untied when ``pp > 1``.
    """
    model_spec.get(model.arch).validate(model, pp, tp)
    require(pp <= model.n_layers, "parallel.pp", pp,
             f"at most model.n_layers = {model.n_layers} (every stage holds at least one block)")
    require(pp == 1 or not model.tie_embeddings, "model.tie_embeddings", model.tie_embeddings,
             f"false with parallel.pp = {pp} (the embedding lives on the first stage, the output projection on "
             "the last): set model.tie_embeddings = false (--model.tie_embeddings false)")


_SECTION_TYPES: dict[str, type] = {
    cls.SECTION: cls for cls in (ModelConfig, DataConfig, TrainingConfig, ParallelConfig, FaultToleranceConfig,
                                  WorkloadConfig, ObserveConfig)
}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(name: str, value: Any, typ: Any) -> Any:
    """Checks (TOML) or parses (CLI strings) ``value`` as ``typ``; ConfigError on mismatch."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        raise _choice_error(name, value, choices)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if type(None) in typing.get_args(typ) and (value is None or (isinstance(value, str)
                                                                     and value.lower() in ("none", "null"))):
            return None
        words = [c for a in args if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        if value in words:
            return value
        typ = next(a for a in args if typing.get_origin(a) is not Literal)
        if words:
            try:
                return _coerce(name, value, typ)
            except ConfigError:
                allowed = " or ".join([f"expected {getattr(typ, '__name__', typ)}", *map(repr, words)])
                raise ConfigError(f"{name} = {value!r} is not allowed: {allowed}") from None
    if typing.get_origin(typ) is tuple and typing.get_args(typ)[0] is DataSource:
        return _sources(name, value)
    from_cli = isinstance(value, str) and typ is not str
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "1", "yes", "on"):
                return True
            if from_cli and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or not (isinstance(value, int) or from_cli):
                raise ValueError
            return int(value.replace("_", "")) if from_cli else value
        if typ is float:
            if isinstance(value, bool) or not (isinstance(value, (int, float)) or from_cli):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except ValueError:
        pass
    else:
        return value
    raise ConfigError(f"{name} = {value!r} is not allowed: expected {getattr(typ, '__name__', typ)}")


def _sources(name: str, value: Any) -> tuple[DataSource, ...]:
    """``data.sources`` from TOML/JSON (a list of ``{path, weight}`` tables) or the command line
    (``PATH=WEIGHT,PATH=WEIGHT``; an empty string for none)."""
    if isinstance(value, str):
        items: list[Any] = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            path, sep, weight = part.rpartition("=")
            try:
                items.append({"path": path, "weight": float(weight)} if sep else {"path": part})
            except ValueError:
                raise ConfigError(f"{name}: {part!r} is not PATH=WEIGHT (e.g. --{name} web=0.7,code=0.3)") from None
        value = items
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name} = {value!r} is not allowed: a list of {{path, weight}} tables")
    out = []
    for item in value:
        if isinstance(item, DataSource):
            out.append(item)
            continue
        if not isinstance(item, dict) or set(item) - {"path", "weight"} or "path" not in item:
            raise ConfigError(f"{name}: {item!r} is not a {{path = ..., weight = ...}} table")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{name}: the weight of {item['path']!r} must be a number, got {weight!r}")
        out.append(DataSource(str(item["path"]), float(weight)))
    return tuple(out)


def _unknown(name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {name!r}{hint}")


def from_dict(raw: dict[str, Any]) -> Config:
    """Builds a validated Config from nested plain data (a parsed TOML file)."""
    known_top = ["name", *_SECTION_TYPES]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "name":
            kwargs["name"] = _coerce("name", value, str)
            continue
        if key not in _SECTION_TYPES:
            raise _unknown(key, known_top)
        if not isinstance(value, dict):
            raise ConfigError(f"[{key}] must be a table of fields, got {value!r}")
        cls = _SECTION_TYPES[key]
        types_ = _field_types(cls)
        fields_ = {}
        for fname, fvalue in value.items():
            full = f"{key}.{fname}"
            if fname not in types_:
                raise _unknown(full, [f"{key}.{n}" for n in types_])
            fields_[fname] = _coerce(full, fvalue, types_[fname])
        kwargs[key] = cls(**fields_)
    return Config(**kwargs)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, fname = key.partition(".")
        if not fname:
            nested[section] = value
        else:
            nested.setdefault(section, {})[fname] = value
    return nested


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--training.steps", "50", "--model.dim=64"]`` -> ``{"training.steps": "50", "model.dim": "64"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.field VALUE "
                              "(e.g. --training.steps 50)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value: write --{key} VALUE")
            i += 1
            value = args[i]
        out[key] = value
        i += 1
    return out


def preset_dirs() -> list[Path]:
    """Where presets are looked up: $RECOVER_CONFIGS, ./configs, and the source tree's configs/."""
    dirs = []
    if os.environ.get("RECOVER_CONFIGS"):
        dirs.append(Path(os.environ["RECOVER_CONFIGS"]))
    dirs.append(Path.cwd() / "configs")
    dirs.append(Path(__file__).resolve().parents[2] / "configs")
    return dirs


def available_presets() -> list[str]:
    names = {p.stem for d in preset_dirs() if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def resolve_preset(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"config file {name_or_path!r} does not exist")
        return path
    for d in preset_dirs():
        candidate = d / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    raise ConfigError(f"unknown preset {name_or_path!r}; available: {', '.join(available_presets()) or 'none'} "
                      "(or give a path to a .toml file)")


RUN_CONFIG = "config.json"
"""A run directory's config: the job's whole config as the launcher resolved it."""


def write_run_config(cfg: Config, run_dir: Path) -> Path:
    """Writes ``cfg`` as ``run_dir``'s :data:`RUN_CONFIG`; returns its path."""
    path = Path(run_dir) / RUN_CONFIG
    path.write_text(json.dumps(cfg.to_dict(), indent=1), encoding="utf-8")
    return path


def _read_run_config(path: Path) -> dict[str, Any]:
    """The fields of a run's ``config.json``, checked to build a valid Config. Raises ConfigError."""
    fix = "give the config.json that `recover launch` wrote into the run directory, or a preset"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run config {path} is unreadable ({exc}); {fix}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"run config {path} is not a JSON object; {fix}")
    try:
        from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path} is not a run config of this recover ({exc}); {fix}") from None
    return raw


def _read_preset(preset: str) -> dict[str, Any]:
    """The fields of a preset (name or .toml path), named after its file unless it names itself."""
    path = resolve_preset(preset)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    raw.setdefault("name", path.stem)
    return raw


def load_config(preset: str, overrides: list[str] | dict[str, str] | None = None) -> Config:
    """Loads a preset (name or .toml path) or a run's ``config.json`` and applies dotted overrides (CLI
    strings or typed values). Raises ConfigError."""
    raw = _read_run_config(Path(preset)) if preset.endswith(".json") else _read_preset(preset)
    if overrides:
        flat = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
        for key in flat:
            section, _, fname = key.partition(".")
            if section not in _SECTION_TYPES:
                raise _unknown(section if not fname else key, [*_SECTION_TYPES, "name"])
        raw = _merge(raw, _nest(flat))
    return from_dict(raw)
