"""``recover launch``, ``recover compare`` and ``recover worker`` (one replica process, started by
``recover launch`` or by hand on each host).

Contract: a launch is a :class:`LaunchRequest` (typed; ``recover launch``'s flags map onto it one
to one) run by :func:`launch`. :func:`check_launch` does every check first, with no side effect:
the config (whose ``__post_init__`` holds every layout rule; ``model.vocab_size`` resolved from the
data unless given, :func:`recover.data.layout.resolve_vocab`), the flags and the failure schedule.
The workers read that config from the run's ``config.json`` (:func:`worker_config`).
Only then does :func:`launch` create the run directory, prepare the data and start processes, so
a bad request is refused in well under a second with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recover.config import Config, load_config, parse_overrides
from recover.coord.tls import Tls, add_tls_flags
from recover.errors import ConfigError, RecoverError
from recover.faults.registry import KILL, random_kinds, registered
from recover.launch.placement import Placement, parse_gpus, place, visible_gpus
from recover.names import BASELINES, Baseline, Event, Phase
from recover.observe.lease import acquire, check_free
from recover.observe.rundir import check_out, clear_run
from recover.train.processes.cli import INIT_FROM_HELP, init_from_override

if TYPE_CHECKING:
    from recover.launch.job import LaunchOptions
    from recover.launch.launcher import Launcher
    from recover.train.processes.worker import ReplicaWorker


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run a multi-replica job on this machine, with real failures",
        description="Start a coordinator and N replica processes and train with in-step recovery. "
                    "Failures are real: --fail R@STEP:PHASE (SIGKILL; steps are 0-based), --hang (the training "
                    "thread stops for good), --freeze (SIGSTOP for good), or --random-failures MTBF_S. Config "
                    "overrides: --section.field VALUE. Everything is checked before anything starts.",
        epilog="Your own model and loop: `recover launch [flags] -- CMD ...` (e.g. `-- python train.py`, a script "
               "on recover.api) runs CMD as each replica instead of the built-in trainer; the fault flags, "
               "--rejoin-after, --resume, --deterministic and the parallel degrees apply to it, the script's "
               "job.steps(N) is the job's step count, and the built-in trainer's model, data and schedule "
               "settings are neither used nor checked.",
    )
    p.add_argument("--config", default="tiny", help="preset name or .toml path")
    p.add_argument("--replicas", type=int, default=None, help="replicas (default: parallel.replicas of the config)")
    p.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="replica ids the coordinator admits: 0..N-1 (default: --replicas); a register beyond is "
                        "refused")
    p.add_argument("--steps", type=int, default=None, help="committed steps (default: training.steps)")
    p.add_argument("--out", required=True, help="run directory")
    for kind in registered().values():  # one flag per fault kind (recover.faults.kinds)
        p.add_argument(kind.flag, action="append", default=[], metavar=kind.metavar,
                       help=kind.usage.format(help=kind.help))
    p.add_argument("--kill-coordinator", default=None, metavar="STEP[:SENT]",
                   help="SIGKILL the coordinator in the middle of step STEP's commit, after SENT of its replies went "
                        "out (default 0); it is restarted and rebuilds the job from what the replicas hold")
    p.add_argument("--fail-rank", type=int, default=None, metavar="K",
                   help="which rank of a replica --fail/--hang/--freeze hits (default: its last rank); the "
                        "replica's other ranks go down with it")
    p.add_argument("--procs-per-replica", type=int, default=None, metavar="P",
                   help="processes per replica, P = pp x tp x fsdp (default: that product)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages inside a replica (parallel.pp)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree inside a replica (parallel.tp)")
    p.add_argument("--fsdp", type=int, default=None, help="FSDP2 shard degree inside a replica (parallel.fsdp)")
    p.add_argument("--device-time-s", type=float, default=None, metavar="T",
                   help="emulate dedicated devices: every microbatch takes at least T seconds of wall time "
                        "(training.device_time_s; for benchmarks and tests on shared CPU cores)")
    p.add_argument("--random-failures", type=float, default=None, metavar="MTBF_S",
                   help="also fail a random live replica at exponential intervals with this mean (seconds)")
    p.add_argument("--random-faults", default=KILL, metavar="KIND[,KIND...]",
                   help=f"what --random-failures does, drawn uniformly per failure: {', '.join(random_kinds())} "
                        "(default kill; a hang is sent as SIGUSR1, which stops the worker's training thread)")
    p.add_argument("--rejoin-after", type=float, default=None, metavar="SECONDS",
                   help="restart a killed replica after this delay; it joins back at the next step boundary")
    p.add_argument("--rejoin-replicas", default=None, metavar="R[,R...]",
                   help="with --rejoin-after: only these replicas rejoin (default: every killed one)")
    p.add_argument("--warm-spares", type=int, default=None, metavar="N",
                   help="with --rejoin-after: keep N spare workers started (torch imported, model and data built) "
                        "that a killed replica's replacement takes, joining in well under a second instead of "
                        "seconds (default: 1 on the CPU; on GPUs 1 where a replica's worth of GPUs holds no rank, "
                        "else 0: a spare needs devices of its own); 0: replacements start afresh")
    p.add_argument("--no-fork-server", action="store_true",
                   help="start each worker as a new interpreter (seconds of imports each) instead of forking it "
                        "from the job's fork server, which imports torch and recover once (for a library that "
                        "does not survive a fork)")
    p.add_argument("--baseline", choices=BASELINES, default=None,
                   help=f"run a baseline instead of recover on the same model, data and failures: "
                        f"{Baseline.describe()}")
    p.add_argument("--deterministic", action="store_true",
                   help="float64 accumulation: every committed step bitwise equal to the failure-free run's")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-failures")
    p.add_argument("--reference", default=None, help="a failure-free run directory to draw under loss.png")
    p.add_argument("--gpus", default=None, metavar="LIST",
                   help="GPUs to use, e.g. 0,1,2,3 (default: all visible): every rank of every replica gets one of "
                        "its own (CUDA_VISIBLE_DEVICES per process); more ranks than GPUs is refused")
    p.add_argument("--share-gpus", action="store_true",
                   help="let ranks share GPUs round robin (for tests on one GPU): every collective runs on gloo")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (per process: replica, rank, device, environment, command) and start nothing")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint (same flags as before)")
    p.add_argument("--init-from", default=None, metavar="PATH", help=INIT_FROM_HELP)
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds another run (deletes its records and checkpoints)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="the coordinator serves Prometheus metrics at http://127.0.0.1:P/metrics (generation, "
                        "members, committed step, failures by cause, goodput); 0: off (default). TensorBoard and "
                        "W&B: --observe.tensorboard true, --observe.wandb offline|online")
    add_tls_flags(p)
    p.set_defaults(func=run_launch, accepts_overrides=True)

    c = sub.add_parser("compare", help="per-step loss difference of a run against a reference run",
                       description="Print the largest per-step relative loss difference of RUN against REF and "
                                   "both final validation losses; exit 1 when it exceeds --tol.")
    c.add_argument("ref")
    c.add_argument("run")
    c.add_argument("--tol", type=float, default=1e-5, help="allowed relative difference (default 1e-5)")
    c.add_argument("--json", default=None, help="also write the comparison to this file")
    c.set_defaults(func=run_compare)

    w = sub.add_parser("worker", help="one replica process of a fault-tolerant job (started by `recover launch`, or "
                                      "by hand on each host with `recover coordinator`)",
                       description="One replica of a fault-tolerant job, connected to a coordinator. `recover launch` "
                                   "starts these itself; across machines start one per replica (under torchrun for a "
                                   "replica of several ranks). Config overrides: --section.field VALUE.")
    w.add_argument("--config", required=True,
                   help="the run's config.json (what `recover launch` passes), a preset name or a .toml path")
    w.add_argument("--out", required=True)
    w.add_argument("--replica", type=int, default=None)
    w.add_argument("--spare", action="store_true",
                   help="start up, then wait on stdin for one JSON line {replica, fail} and join as that replica")
    w.add_argument("--coordinator", required=True, help="HOST:PORT")
    w.add_argument("--token-file", required=True)
    w.add_argument("--procs", type=int, default=1, help="replica processes sharing this machine (threads)")
    w.add_argument("--fail", action="append", default=[], metavar="R@STEP:PHASE[#RANK]",
                   help=f"die at STEP and PHASE (on RANK, default the last); phases: {Phase.describe()}")
    w.add_argument("--join", action="store_true",
                   help="join the running job at its next step boundary, taking the live replicas' state (a worker "
                        "that registers after the job began does so without it: a restarted pod or srun step)")
    w.add_argument("--baseline", choices=BASELINES, default=None, help=Baseline.describe())
    w.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint in --out")
    add_tls_flags(w)
    w.set_defaults(func=run_worker, accepts_overrides=True)


@dataclass(frozen=True)
class LaunchRequest:
    """What ``recover launch`` is asked to run; every field is one of its flags (None: the config's)."""

    out: Path
    """The run directory."""
    config: str = "tiny"
    """Preset name or ``.toml`` path."""
    overrides: tuple[str, ...] = ()
    """Config overrides, ``--section.field VALUE``."""
    replicas: int | None = None
    max_replicas: int | None = None
    """Replica ids the coordinator admits are ``0..max_replicas - 1`` (None: ``replicas``)."""
    tls: tuple[str | None, str | None, str | None] = (None, None, None)
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``: the coordinator wire over TLS (all three) or not (none)."""
    steps: int | None = None
    pp: int | None = None
    tp: int | None = None
    fsdp: int | None = None
    procs_per_replica: int | None = None
    """Must equal pp x tp x fsdp when given."""
    deterministic: bool = False
    device_time_s: float | None = None
    """Emulated device time per microbatch (``training.device_time_s``)."""
    failures: tuple[str, ...] = ()
    """Failure specs ``R@STEP[:PHASE][=KIND[:ARG]]`` (a kill without the suffix)."""
    fail_rank: int | None = None
    """Which rank of a replica the failures kill (None: its last)."""
    random_mtbf_s: float | None = None
    random_faults: tuple[str, ...] = (KILL,)
    """What each random failure does: some of :func:`~recover.faults.random_kinds`."""
    rejoin_after_s: float | None = None
    rejoin_replicas: frozenset[int] | None = None
    """With ``rejoin_after_s``: only these replicas rejoin (None: every killed one)."""
    warm_spares: int | None = None
    """With ``rejoin_after_s``: spare workers kept started (None: :func:`warm_spares`' default)."""
    fork_workers: bool = True
    """Workers forked from the job's fork server (False: ``--no-fork-server``)."""
    baseline: Baseline | None = None
    seed: int = 0
    """Seed of the random failures."""
    reference: Path | None = None
    """A failure-free run directory to draw under ``loss.png``."""
    progress: bool = True
    resume: bool = False
    """Continue the run in ``out`` from its newest complete checkpoint."""
    overwrite: bool = False
    """Replace the run ``out`` holds (its records and checkpoints are deleted when the launch starts)."""
    kill_coordinator: str | None = None
    """Fault injection ``STEP[:SENT]`` (see :class:`~recover.launch.job.LaunchOptions`)."""
    metrics_port: int = 0
    """``--metrics-port``: the coordinator's Prometheus endpoint (0: none)."""
    gpus: str | None = None
    """``--gpus``: the GPUs to place ranks on (None: all visible)."""
    share_gpus: bool = False
    dry_run: bool = False
    """Print the plan and start nothing."""
    init_from: str | None = None
    """``--init-from``: the weights every replica starts from (``training.init_from``)."""
    script: tuple[str, ...] = ()
    """``-- CMD ...``: each replica runs this command (a script on :mod:`recover.api`), not ``recover worker``."""


def launch_config(req: LaunchRequest) -> Config:
    """The job's config (flags folded into dotted overrides; the vocabulary resolved from the data)."""
    flags = {"parallel.replicas": req.replicas, "training.steps": req.steps, "parallel.pp": req.pp,
             "parallel.tp": req.tp, "parallel.fsdp": req.fsdp,
             "training.deterministic": "true" if req.deterministic else None,
             "training.device_time_s": req.device_time_s}
    overrides = [*req.overrides, *(f"--{key}={value}" for key, value in flags.items() if value is not None),
                 *init_from_override(req.init_from)]
    if req.script:  # the built-in trainer's schedule is not the script's: nothing to check it against
        neutral = [*SCRIPT_NEUTRAL, *overrides]
        if not any(o.split("=")[0] == "--training.global_microbatches" for o in overrides):
            flat, base = parse_overrides(neutral), load_config(req.config)
            ranks = int(flat.get("parallel.replicas", base.parallel.replicas)) * int(
                flat.get("parallel.fsdp", base.parallel.fsdp))
            m = max(base.training.global_microbatches, ranks)
            neutral.append(f"--training.global_microbatches={m}")  # the script's own M is its Job's
        return load_config(req.config, neutral)
    return _resolve_vocab(load_config(req.config, overrides), overrides)


SCRIPT_NEUTRAL = ("--training.warmup_steps=0",)
"""Settings of the built-in trainer a script does not use, set so that their checks against the flags a
script does use cannot refuse its launch (a preset's ``warmup_steps`` above ``--steps 3``); so is
``training.global_microbatches`` (at least ``--replicas`` x fsdp: the built-in M, not the script's)."""


def _resolve_vocab(cfg: Config, overrides: list[str]) -> Config:
    """``cfg`` with the data's vocabulary unless ``--model.vocab_size`` is among ``overrides``."""
    from recover.data.layout import given, resolve_data_dir, resolve_vocab

    return resolve_vocab(cfg, resolve_data_dir(cfg.data), given(overrides, "model.vocab_size"))


def worker_config(config: str, overrides: list[str]) -> Config:
    """A worker's config: a run's ``config.json`` as the launcher wrote it (everything resolved), else a
    preset and overrides with the data's vocabulary, as the launcher resolves it (a worker started by hand).

    Raises:
        ConfigError: one line naming the file or field (an unreadable or foreign ``config.json`` too).
    """
    if config.endswith(".json"):
        return load_config(config, overrides)
    return _resolve_vocab(load_config(config, overrides), overrides)


def check_launch(req: LaunchRequest) -> LaunchOptions:
    """Every check of a launch, with no side effect (but one note on stderr when the data's token ids are not
    recorded, :func:`recover.data.verify.check_data`); returns the launcher's options.

    Raises:
        ConfigError: the first problem found (config, flags or failure schedule), one line with the fix.
    """
    from recover.data.layout import resolve_data_dir
    from recover.data.verify import check_data, check_windows
    from recover.faults import FailureSchedule, parse_failure
    from recover.launch.job import LaunchOptions
    from recover.observe.prometheus import MetricsServer
    from recover.observe.sinks import check_extras

    cfg = launch_config(req)
    p, ft = cfg.parallel, cfg.fault_tolerance
    P = p.procs_per_replica
    placement = place(p.replicas, P, parse_gpus(req.gpus) if req.gpus else visible_gpus(), req.share_gpus)
    if placement.shared and p.backend != "gloo":  # NCCL allows one rank per device (also when no GPU was found)
        cfg = launch_config(replace(req, overrides=(*req.overrides, "--parallel.backend=gloo")))
        p, ft = cfg.parallel, cfg.fault_tolerance
    if req.procs_per_replica is not None and req.procs_per_replica != P:
        raise ConfigError(f"--procs-per-replica {req.procs_per_replica} does not match pp x tp x fsdp = {p.pp} x "
                          f"{p.tp} x {p.fsdp} = {P}; give the degrees with --pp/--tp/--fsdp so their product is P")
    if req.fail_rank is not None and not 0 <= req.fail_rank < P:
        raise ConfigError(f"--fail-rank {req.fail_rank} is not allowed: a replica has ranks 0..{P - 1}")
    schedule = FailureSchedule([parse_failure(f, req.fail_rank) for f in req.failures])
    schedule.validate(p.replicas, cfg.training.steps, ft.min_replicas, rejoin=req.rejoin_after_s is not None, ranks=P)
    if req.random_mtbf_s is not None and req.random_mtbf_s <= 0:
        raise ConfigError(f"--random-failures {req.random_mtbf_s} is not allowed: a positive MTBF in seconds")
    odd = [f for f in req.random_faults if f not in random_kinds()]
    if odd or not req.random_faults:
        raise ConfigError(f"--random-faults {','.join(req.random_faults)} is not allowed: some of "
                          f"{', '.join(random_kinds())}, comma-separated")
    if req.rejoin_after_s is not None and req.rejoin_after_s < 0:
        raise ConfigError(f"--rejoin-after {req.rejoin_after_s} is not allowed: seconds >= 0")
    if req.rejoin_replicas is not None and not req.rejoin_replicas <= set(range(p.replicas)):
        raise ConfigError(f"--rejoin-replicas {','.join(map(str, sorted(req.rejoin_replicas)))} is not allowed: "
                          f"replicas are 0..{p.replicas - 1}")
    spares = warm_spares(req, placement, P)
    tls = Tls.from_flags(*req.tls)
    if req.max_replicas is not None and req.max_replicas < p.replicas:
        raise ConfigError(f"--max-replicas {req.max_replicas} is not allowed: at least --replicas ({p.replicas})")
    if req.baseline == Baseline.RESTART and cfg.training.checkpoint_every == 0:
        raise ConfigError(f"--baseline {Baseline.RESTART} needs periodic checkpoints: set --training.checkpoint_every "
                          "K (`recover bench failures` picks K by Young/Daly)")
    if req.baseline and req.rejoin_after_s is not None:
        raise ConfigError("--rejoin-after applies to recover; the baselines run on the survivors")
    if req.baseline and P > 1:
        raise ConfigError(f"--baseline {req.baseline} runs one process per replica; drop --pp/--tp/--fsdp "
                          f"(this replica has {P} ranks)")
    if req.kill_coordinator is not None:
        from recover.coord.cli import parse_die_at_commit

        kill_step, _ = parse_die_at_commit(req.kill_coordinator) or (0, 0)
        if kill_step >= cfg.training.steps:
            raise ConfigError(f"--kill-coordinator {req.kill_coordinator}: step {kill_step} is beyond the run's "
                              f"{cfg.training.steps} steps (0-based)")
    check_free(Path(req.out))  # a live job's directory: refused whatever the flags, naming its holder
    check_out(Path(req.out), req.resume, req.overwrite)
    check_extras(cfg.observe)
    if req.metrics_port:  # taken now: refused here in one line, not by the coordinator once it all started
        MetricsServer("127.0.0.1", req.metrics_port).close()
    if req.resume:
        check_resume(cfg, Path(req.out), script=bool(req.script))
        if req.baseline:
            raise ConfigError("--resume continues a recover run; the baselines restart by themselves")
    if req.script and cfg.training.init_from:
        raise ConfigError(f"--init-from {cfg.training.init_from}: a script builds its own model, and recover loads "
                          "weights into the built-in models only; load yours in the script before recover.Job(...) "
                          "(e.g. model.load_state_dict(...)), or resume a script's run with --resume")
    if cfg.training.init_from:  # a source that does not fit is refused here, not by every worker
        from recover.train.checkpoints.weights import check_init_from

        check_init_from(cfg.training.init_from, cfg.model)
    parts, vals, notes = ([] if req.script else cfg.data.parts()), [], []  # a script reads its own data
    for part, _ in parts:  # every source: headers, recorded ids, windows (a built-in corpus: prepared later)
        data_dir = resolve_data_dir(part)  # a missing directory is refused here, not by the workers
        if data_dir.is_dir() and any(data_dir.iterdir()):
            vals.append(check_data(part, data_dir, cfg.model.vocab_size, hint=notes.append)[1])
    if parts and len(vals) == len(parts):  # validation reads every source's split together
        check_windows(vals, cfg.data.seq_len, cfg.data.microbatch_size, "val")
    for line in notes:  # only once nothing is refused: a refusal is one line
        print(f"recover: note: {line}", file=sys.stderr)
    return LaunchOptions(config=cfg, out=Path(req.out),
                         failures=schedule, random_mtbf_s=req.random_mtbf_s,
                         random_faults=req.random_faults, rejoin_after_s=req.rejoin_after_s,
                         rejoin_replicas=req.rejoin_replicas, warm_spares=spares, seed=req.seed, baseline=req.baseline,
                         fork_workers=req.fork_workers,
                         progress=req.progress, resume=req.resume, kill_coordinator=req.kill_coordinator,
                         metrics_port=req.metrics_port,
                         placement=placement, script=req.script, max_replicas=req.max_replicas or p.replicas, tls=tls,
                         title=f"{cfg.name} x{p.replicas}" + (f" (x{P} ranks)" if P > 1 else ""))


def check_resume(cfg: Config, out: Path, script: bool = False) -> None:
    """What ``--resume`` needs, from the newest complete checkpoint under ``out`` before any process starts:
    one to resume from, written for this model (one of another model would be refused by every worker, once
    each), and no more steps in it than the run has. A script's checkpoint holds its own model and its step
    count is the script's (``job.steps``): only that one exists is checked here; the script's ``Job`` checks
    the rest.

    Raises:
        ConfigError: one line naming the checkpoint and the fix.
    """
    from recover.errors import CheckpointError, IncompatibleCheckpoint
    from recover.train.checkpoints.integrity import check_compatible, list_checkpoints, read_meta

    found = list_checkpoints(out / "checkpoints")
    if not found:
        raise ConfigError(f"--resume: no complete checkpoint under {out / 'checkpoints'}; run without "
                          "--resume to start afresh (a checkpoint is saved on SIGTERM, on quorum loss and every "
                          "training.checkpoint_every steps)")
    step, path = found[-1]
    if script:
        return
    try:
        check_compatible(read_meta(path), cfg.model, path)
    except IncompatibleCheckpoint as exc:
        raise ConfigError(f"--resume: {exc}") from None
    except CheckpointError:
        pass  # damaged: the workers name it and fall back to an older one
    if step > cfg.training.steps:
        raise ConfigError(f"--resume: the newest checkpoint, {path}, holds {step} committed steps, more than "
                          f"training.steps = {cfg.training.steps}: give --steps {step} or more (or a new --out)")


def warm_spares(req: LaunchRequest, placement: Placement, ranks: int) -> int:
    """How many warm spares the launch keeps: ``--warm-spares``, else 1 on the CPU, 1 on GPUs when ``ranks``
    of them hold no rank (a spare holds its devices while it waits), else 0; none without rejoins or for a
    script (which starts as the replica it is told to be). Raises ConfigError."""
    if req.warm_spares is None:
        wanted = req.rejoin_after_s is not None and not req.script
        return len(placement.spare_devices(ranks, 1)) if wanted else 0
    if req.warm_spares < 0:
        raise ConfigError(f"--warm-spares {req.warm_spares} is not allowed: a count >= 0")
    if req.warm_spares and req.rejoin_after_s is None:
        raise ConfigError("--warm-spares replaces killed replicas: give --rejoin-after too")
    if req.warm_spares and req.script:
        raise ConfigError("--warm-spares applies to `recover worker` replicas, not to a script")
    if req.warm_spares > len(placement.spare_devices(ranks, req.warm_spares)):
        raise ConfigError(f"--warm-spares {req.warm_spares} needs {req.warm_spares * ranks} GPUs that hold no rank; "
                          f"{len(placement.unused)} do ({','.join(placement.unused) or 'none'}): give more --gpus "
                          "or fewer spares")
    return req.warm_spares


def launch(req: LaunchRequest) -> int:
    """Runs a job: checks everything, then creates the run directory, prepares the data and starts it.

    Returns:
        The launcher's exit status: 0 when every step committed, 3 when too few replicas survived,
        6 when stopped on request (SIGTERM, SIGINT) with a checkpoint, 7 when the coordinator was lost
        for good (a checkpoint was saved), 12 when the storage refused the checkpoint the job ended with,
        1 otherwise.

    Raises:
        ConfigError: from :func:`check_launch`, before anything is created or started.
    """
    from recover.data.prepare import prepared_data_dir
    from recover.launch.job import Commands
    from recover.launch.launcher import Launcher
    from recover.train.processes.exits import (
        EXIT_BAD_DATA,
        EXIT_COORDINATOR_LOST,
        EXIT_DIVERGED,
        EXIT_NONFINITE,
        EXIT_QUORUM_LOST,
        EXIT_SCRIPT_ERROR,
        EXIT_STATE_LOST,
        EXIT_STOPPED,
        EXIT_UNSAVED,
    )

    opts = check_launch(req)
    if req.dry_run:
        for line in Commands(opts).plan():
            print(line)
        return 0
    with acquire(opts.out, "recover launch") as lease:  # before anything is written; released at the end
        lease.start_renewing()
        if lease.took_over:
            print(f"recover: note: took over --out's lease from {lease.took_over}", file=sys.stderr)
        if req.overwrite:
            clear_run(opts.out)
        opts.out.mkdir(parents=True, exist_ok=True)
        if not req.script:
            prepared_data_dir(opts.config.data, quiet=not req.progress)
        launcher = Launcher(opts)
        code = launcher.run()
        unwritten = _report(launcher, opts, req.reference)
    for line in launcher.supervisor.oom_lines:
        print(line, file=sys.stderr)
    if launcher.skipped_saves:
        print(f"recover: warning: {len(launcher.skipped_saves)} checkpoint(s) skipped, the first: "
              f"{launcher.skipped_saves[0]}", file=sys.stderr)
    if unwritten:  # after the job's own line (a finished job's is this one)
        unwritten = (f"recover: the storage refused the launcher's records with {launcher.written + 1} committed "
                     f"steps recorded: {unwritten}; free some space and run `recover collect {opts.out}` to write them")
    if unwritten and code == 0:
        print(unwritten, file=sys.stderr)
        code, unwritten = EXIT_UNSAVED, None
    elif code == EXIT_UNSAVED:
        lost = [e for e in _events(opts.out) if e.get("kind") == Event.CHECKPOINT_UNSAVED][-1:]
        why = lost[0]["message"] if lost else "the storage refused the final checkpoint"
        print(f"recover: the job ended after {launcher.written + 1} committed steps without its final checkpoint: "
              f"{why}", file=sys.stderr)
    elif code == EXIT_QUORUM_LOST and launcher.all_lost:
        print(f"recover: the job stopped: {_everyone_lost(opts.out, launcher.rescued)}", file=sys.stderr)
    elif code == EXIT_QUORUM_LOST:
        print("recover: the job stopped because too few replicas survived; a complete checkpoint was saved "
              f"under {opts.out / 'checkpoints'}", file=sys.stderr)
    elif code == EXIT_STATE_LOST:
        print("recover: the job stopped: every replica holding the training state was lost and there was no "
              f"complete checkpoint under {opts.out / 'checkpoints'} to fall back to; start it afresh (the same "
              "command with --overwrite), with --training.checkpoint_every set", file=sys.stderr)
    elif code in (EXIT_STOPPED, EXIT_COORDINATOR_LOST):
        why = "on request" if code == EXIT_STOPPED else "because the coordinator did not come back"
        print(f"recover: the job stopped {why} after {launcher.written + 1} committed steps; a complete checkpoint is "
              f"under {opts.out / 'checkpoints'}; continue with the same command and --resume", file=sys.stderr)
    elif code in (EXIT_DIVERGED, EXIT_NONFINITE):
        kinds = {EXIT_DIVERGED: Event.DIVERGED, EXIT_NONFINITE: Event.NONFINITE_DIVERGENCE}
        last = [e for e in _events(opts.out) if e.get("kind") == kinds[code]][-1:]
        if code == EXIT_DIVERGED:
            sides = "; ".join(f"replicas {rs} hold {fp}" for fp, rs in (last[0]["sides"] if last else {}).items())
            of = "gradients of the audited microbatch" if last and last[0].get("check") == "audit" else "parameters"
            what = (f"the replicas' {of} disagree at step {last[0]['step'] if last else '?'} with no majority "
                    f"to trust ({sides}); each side's state is under {opts.out / 'checkpoints' / 'diverged'}")
            if last and last[0].get("message") and (last[0].get("check") == "samples" or last[0]["step"] == 0):
                what = f"{last[0]['message']}; each side's state is under {opts.out / 'checkpoints' / 'diverged'}"
        else:
            e = last[0] if last else {"id": "?", "step": "?", "replicas": []}
            which = (f"microbatch {e['id']} of step {e['step']} was not finite on replicas {e['replicas']}"
                     if e.get("id") is not None else
                     f"the microbatches of step {e['step']} were not finite on every replica {e['replicas']}")
            what = f"{which}: the training diverged; the last committed state is under {opts.out / 'checkpoints'}"
        print(f"recover: the job stopped: {what}", file=sys.stderr)
    elif code == EXIT_BAD_DATA:
        bad = [e for e in _events(opts.out) if e.get("kind") == Event.BAD_DATA][:1]
        why = bad[0]["message"] if bad else "a microbatch held a token id beyond the vocabulary"
        print(f"recover: the job stopped on bad data: {why}. The last committed state is under "
              f"{opts.out / 'checkpoints'}; fix the data (`recover prepare --verify DIR` finds every bad id) and "
              "continue with --resume", file=sys.stderr)
    elif code == EXIT_SCRIPT_ERROR:
        from recover.observe.events import read_jsonl

        raised = [e for e in read_jsonl(opts.out / "events.jsonl") if e.get("kind") == Event.SCRIPT_ERROR]
        e = launcher.script_error or (raised[-1] if raised else {})
        print(f"recover: the job stopped after {launcher.written + 1} committed steps: the script raised "
              f"{e.get('type', 'an exception')} at {e.get('place', '?')}: {e.get('message', '')} (replica "
              f"{e.get('replica', '?')}'s log is under {opts.out / 'logs'}); the newest complete checkpoint under "
              f"{opts.out / 'checkpoints'} (if any) is where --resume continues once it is fixed", file=sys.stderr)
    elif launcher.start_failed is not None:
        print(f"recover: the job could not start: {launcher.start_failed}", file=sys.stderr)
    elif launcher.stop_signal is not None:
        print(f"recover: stopped by signal {launcher.stop_signal} without reaching a step boundary within "
              f"fault_tolerance.stop_grace_s; the newest complete checkpoint under {opts.out / 'checkpoints'} "
              "(if any) is where --resume continues", file=sys.stderr)
    if unwritten:
        print(unwritten, file=sys.stderr)
    return code


def _events(out: Path) -> list[dict[str, Any]]:
    """The run's events, for the line it ends with (none when the run directory is gone)."""
    from recover.observe.events import read_jsonl

    try:
        return list(read_jsonl(out / "events.jsonl"))
    except OSError:
        return []


LOST_AS = {"connection_closed": "died", "process_died": "died", "heartbeat_timeout": "went silent", "hung": "hung"}
"""How a replica was lost, by the cause of its ``failure_detected``, in the line of a job that lost them all."""


def _everyone_lost(out: Path, rescued: Path | None = None) -> str:
    """The line of a job whose every replica was fenced or killed with none to come back: who went how, and
    the newest complete checkpoint to resume from (``rescued``: one a replica cut off from the coordinator
    kept, put in place by the launcher)."""
    from recover.train.checkpoints.integrity import list_checkpoints

    causes = {e["replica"]: e.get("cause", "lost") for e in _events(out)
              if e.get("kind") == Event.FAILURE_DETECTED and "replica" in e}
    how = ", ".join(f"replica {r} {LOST_AS.get(c, c)}" for r, c in sorted(causes.items())) or "fenced or killed"
    step, path = list_checkpoints(out / "checkpoints")[-1]
    if rescued is not None and rescued == path:
        return (f"every replica was cut off from the coordinator (its host unreachable from theirs); the lowest "
                f"kept the committed state, now {path} (step {step}): mend the network and continue with the same "
                "command and --resume")
    return (f"every replica was lost ({how}) and none was to come back (no --rejoin-after); the newest complete "
            f"checkpoint is {path} (step {step}): continue with the same command and --resume, redoing the steps "
            "after it")


def _report(launcher: Launcher, opts: LaunchOptions, reference: Path | None) -> str | None:
    """Summary, recovery events, plots and the one-line result of a finished run; returns the line naming
    ``summary.json`` when the storage refused it (a full disk), else None."""
    from recover.launch.report import plot_run, summarize
    from recover.observe.events import EventLog
    from recover.observe.rundir import refused

    out = opts.out
    summary = summarize(out, opts.config.name, launcher.wall_s, write=False)
    unwritten = None
    try:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    except OSError as exc:
        unwritten = refused(out / "summary.json", exc)
        with contextlib.suppress(OSError):
            (out / "summary.json").unlink(missing_ok=True)  # never a torn one
    with contextlib.suppress(OSError):  # the run directory gone for good: the summary line says the rest
        with EventLog(out / "events.jsonl") as events:  # kill -> all survivors computing again, per kill
            for rec in summary["recoveries"]:
                events.event(Event.RECOVERY, **rec)
    try:
        if opts.config.observe.plots:
            plot_run(out, reference)
    except Exception as exc:  # a plot never fails a run
        print(f"warning: plots not written: {exc}", file=sys.stderr)
    with contextlib.suppress(OSError):
        for text in launcher.supervisor.failed_logs():
            print(text, file=sys.stderr)
    lat = summary["recovery_latency_ms_median"]
    extra = "".join(f"; nobody held the state: restored step {r['step']} ({r['redo']} steps redone)"
                       for r in summary["restores"])
    extra += f"; grew by replicas {summary['grown']}" if summary["grown"] else ""
    extra += f"; drained replicas {summary['drained']}" if summary["drained"] else ""
    print(f"{summary['committed_steps']} steps committed in {summary['wall_s']:.1f} s; microbatches per step "
          f"{summary['min_microbatches']}..{summary['max_microbatches']}; kills {summary['kills']}, rejoins "
          f"{summary['rejoins']}{extra}; median recovery {lat if lat is not None else '-'} ms; "
          f"goodput {100 * summary['goodput']['ettr']:.1f}%; "
          f"final val loss {summary['final_val_loss']}; outputs in {out}", flush=True)
    return unwritten


def _ids(flag: str, text: str | None) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected replica ids like 1,3") from None


def fault_specs(args: argparse.Namespace) -> tuple[str, ...]:
    """The failure specs the fault kinds' flags ask for (each parsed by its kind), in the kinds' order."""
    return tuple(str(kind.parse(text)) for kind in registered().values()
                 for text in getattr(args, kind.flag.lstrip("-").replace("-", "_")))


def run_launch(args: argparse.Namespace) -> int:
    """``recover launch``: the flags as a :class:`LaunchRequest`, run by :func:`launch`."""
    return launch(LaunchRequest(
        out=Path(args.out), config=args.config, overrides=tuple(args.overrides), replicas=args.replicas,
        max_replicas=args.max_replicas, tls=(args.tls_cert, args.tls_key, args.tls_ca),
        steps=args.steps, pp=args.pp, tp=args.tp, fsdp=args.fsdp, procs_per_replica=args.procs_per_replica,
        deterministic=args.deterministic, device_time_s=args.device_time_s, fail_rank=args.fail_rank,
        failures=fault_specs(args),
        random_mtbf_s=args.random_failures, rejoin_after_s=args.rejoin_after,
        random_faults=tuple(f.strip().lower() for f in args.random_faults.split(",") if f.strip()),
        rejoin_replicas=_ids("--rejoin-replicas", args.rejoin_replicas), warm_spares=args.warm_spares,
        fork_workers=not args.no_fork_server,
        baseline=Baseline(args.baseline) if args.baseline else None, seed=args.seed,
        reference=Path(args.reference) if args.reference else None, progress=not args.no_progress,
        resume=args.resume, overwrite=args.overwrite, kill_coordinator=args.kill_coordinator,
        metrics_port=args.metrics_port, gpus=args.gpus,
        share_gpus=args.share_gpus, dry_run=args.dry_run, init_from=args.init_from,
        script=tuple(getattr(args, "script", ()))))


def run_compare(args: argparse.Namespace) -> int:
    from recover.launch.report import compare

    res = compare(Path(args.ref), Path(args.run))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    ok = res["max_rel_loss_diff"] <= args.tol and res["steps_compared"] == res["steps_ref"]
    print(f"steps compared: {res['steps_compared']} (reference {res['steps_ref']}, run {res['steps_run']})")
    print(f"max relative loss difference: {res['max_rel_loss_diff']:.3e} at step {res['worst_step']} "
          f"(tolerance {args.tol:.1e}){'; bitwise equal' if res['bitwise_equal'] else ''}")
    print(f"final validation loss: reference {res['final_val_loss_ref']}, run {res['final_val_loss_run']}")
    print(f"min microbatches per step in run: {res['min_microbatches_run']}")
    print("OK" if ok else "DIFFERENT: above tolerance or steps missing")
    return 0 if ok else 1


def run_worker(args: argparse.Namespace) -> int:
    """``recover worker``: the built-in replica, started through :mod:`recover.train.processes.process` like a
    script."""
    from recover.observe.sinks import check_extras
    from recover.train.checkpoints.checkpoint import prefork_writer
    from recover.train.processes.exits import EXIT_STOPPED
    from recover.train.processes.process import Launched, exit_process, prepare
    from recover.train.processes.worker import ReplicaWorker, build

    holder: list[ReplicaWorker] = []

    def stop(signum: int, frame: Any) -> None:  # SIGTERM: a leave, SIGINT: a stop (see train/processes/worker.py)
        if holder:
            holder[0].request_stop(signum)
        else:  # still starting up: nothing to save
            exit_process(0 if signum == signal.SIGTERM else EXIT_STOPPED)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    cfg = worker_config(args.config, args.overrides)
    prepare(cfg)
    check_extras(cfg.observe)
    prefork_writer(cfg)  # before the first thread starts; the first periodic save finds it ready
    replica, fails, join, built = args.replica, args.fail, args.join, None
    if args.spare:  # a hot spare: pay the start-up cost now, learn who to be when a replica dies
        built = build(cfg, args.procs)
        line = sys.stdin.readline()
        if not line.strip():
            exit_process(0)  # the launcher closed our stdin: not needed
        order = json.loads(line)
        replica, fails, join = int(order["replica"]), list(order.get("fail", [])), True
    if replica is None:
        raise RecoverError("recover worker needs --replica R (or --spare)")
    launched = Launched.from_flags(args.out, replica, args.coordinator, args.token_file, fails, join=join,
                                   resume=args.resume, tls=Tls.from_flags(args.tls_cert, args.tls_key, args.tls_ca))
    worker = ReplicaWorker(cfg, launched, procs=args.procs, built=built,
                           baseline=Baseline(args.baseline) if args.baseline else None)
    holder.append(worker)
    exit_process(worker.run())
