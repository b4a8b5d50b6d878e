"""``recover launch``: one coordinator and N replica processes on this machine, with real failures.

Contract:
- Everything is validated before any process starts (config, failure schedule, flags:
  :func:`recover.launch.cli.check_launch`). Constructing a :class:`Launcher` prepares the run
  directory (its ``config.json``, which every worker reads, and what ``resume`` keeps); :meth:`Launcher.run`
  starts the job and returns its exit status.
- The processes (the coordinator and its restarts, the replicas' ranks, hot spares, rejoins, fences,
  the checkpoint-and-restart baseline) are the :class:`~recover.launch.supervisor.Supervisor`'s; on
  exit, error or Ctrl-C every process it started is killed by PID, and one the launcher could not
  clean up after (it was SIGKILLed itself) dies with it (:mod:`recover.lifeline`).
- Failures are real: ``--fail`` specs make a replica SIGKILL itself at (step, phase), ``--hang``
  stop its training thread for good, ``--freeze`` SIGSTOP it for good; ``--random-failures MTBF``
  strikes a random training replica when the :class:`~recover.launch.faultclock.FaultClock` says so.
  ``--rejoin-after S`` restarts a killed replica S seconds later; it joins back at the next step boundary.
- The launcher is the single writer of ``metrics.jsonl``: one record per committed step, merged from
  the replicas' own logs (``replicas/replica_R.jsonl``) by the rule of :mod:`recover.launch.records`
  (``recover collect`` merges by the same), written as steps commit and again, final, at the end.
- SIGTERM, SIGINT or SIGHUP (the terminal hung up: what would be printed goes to ``logs/launcher.log``)
  is a graceful stop: the coordinator is sent SIGTERM and every worker SIGINT
  (SIGTERM to one worker alone is that replica's graceful leave, :mod:`recover.train.processes.worker`), the next
  commit is a stop, the lowest live replica saves a complete checkpoint, and everything exits; after
  ``fault_tolerance.stop_grace_s`` whatever still runs is killed. A second signal kills at once.
  Exit statuses: 0 every step committed, 3 quorum lost (also when every replica was fenced or killed
  with none to come back and an older complete checkpoint exists; with none, 11), 6 stopped with a
  checkpoint (continue with ``--resume``), 7 the coordinator was lost for good (a checkpoint was
  saved), 8 the replicas' parameters disagree with no majority (each side saved), 9 the training
  diverged (a microbatch not finite on two replicas, or some on every replica in one step), 10 bad
  data, 11 every replica holding the state lost with no checkpoint to fall back to (with one, the
  replicas that come back restore it and the job goes on), 12 the storage refused the checkpoint the
  job ended with (before any other: the committed steps are recorded, the older checkpoints kept) or,
  the job finished, the launcher's ``summary.json``, 13 a user's script raised the same exception again (see
  below), 1 otherwise.
- A user's script that raises (a ``script_error`` event, :mod:`recover.train.processes.script`): the launcher prints
  at once the replica, the exception's last lines and its log's path, and whether the job goes on (the
  first time: the replica is lost and rejoins like a killed one) or stops (the same exception again, or a
  broken contract): then it stops the others as a graceful stop does (their leader saves the committed
  state) and exits with 13, whatever else the replicas exited with.
- Once every step is committed, a replica still running after ``fault_tolerance.stop_grace_s`` (stuck
  in its exit) is killed (``exit_grace_over``); the status stays 0. A replica writing the checkpoint the
  job ends with (``checkpoint_final``: the last step's, a stop's) is waited for, at most
  ``training.checkpoint_timeout_s`` from its start; one cut short then makes the status 12, with a
  line naming the newest complete checkpoint (``checkpoint_timeout``).
- ``resume``: the workers start from the newest complete checkpoint in ``out``; the records of
  ``metrics.jsonl`` before it are kept (it holds each step once), completed from the replicas' own logs
  where a torn or lost line took one; a step no record holds is named in one warning line and counted
  committed (its training is in the checkpoint).
- The run directory removed while the job runs: what the launcher owns and its processes read is created
  again (:meth:`Launcher._keep_run_dir`) and the job goes on.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from recover.config import write_run_config
from recover.launch.faultclock import FaultClock
from recover.launch.job import LaunchOptions
from recover.launch.processes import LOST
from recover.launch.records import JsonlTail, LogEpochs, StepRecords, metrics_row, recover_rows, stamp, write_metrics
from recover.launch.supervisor import POLL_S, Supervisor
from recover.names import Event
from recover.observe.events import EventLog, JsonlWriter
from recover.observe.progress import ProgressDisplay
from recover.train.processes.exits import (
    EXIT_BAD_DATA,
    EXIT_COORDINATOR_LOST,
    EXIT_DIVERGED,
    EXIT_NONFINITE,
    EXIT_QUORUM_LOST,
    EXIT_RAISED,
    EXIT_SCRIPT_ERROR,
    EXIT_STATE_LOST,
    EXIT_STOPPED,
    EXIT_UNSAVED,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop the job gracefully (SIGHUP: the terminal the launcher ran in hung up)."""
JOINER_GRACE_S = 3.0
"""How long joiners left alone after the last committed step get to exit on their own before being stopped."""
EXIT_ORDER = (EXIT_UNSAVED, EXIT_SCRIPT_ERROR, EXIT_DIVERGED, EXIT_NONFINITE, EXIT_BAD_DATA, EXIT_STATE_LOST,
              EXIT_QUORUM_LOST, EXIT_COORDINATOR_LOST, EXIT_STOPPED)
"""An unfinished job's exit status: the first of these that a replica exited with (else 1); a finished
job's is 0, or :data:`EXIT_UNSAVED` when its final checkpoint could not be written; a script's recurring
exception (:data:`EXIT_SCRIPT_ERROR`) is the status of either, unless the final checkpoint was not written."""


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``3-5, 9``."""
    out: list[str] = []
    for s in sorted(steps):
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def newest_complete(root: Path) -> str:
    """Where ``--resume`` would continue from: the newest complete checkpoint under ``root``, named."""
    from recover.train.checkpoints.integrity import list_checkpoints

    found = list_checkpoints(root)
    if not found:
        return f"there is no complete checkpoint under {root}"
    return f"the newest complete checkpoint is {found[-1][1]} (step {found[-1][0]}), where --resume continues"


def rescue(root: Path) -> Path | None:
    """After every replica was lost: the newest checkpoint kept by a replica cut off from the coordinator
    (``root/cut_off/replica_R/step_N``, :data:`recover.observe.rundir.CUT_OFF_DIR`) put in place as
    ``root/step_N`` when it is newer than every complete checkpoint there (every replica was cut off:
    the committed state lives on); the kept ones are removed. Also at the start of ``--resume``.
    Returns the checkpoint put in place."""
    import shutil

    from recover.observe.rundir import CUT_OFF_DIR
    from recover.train.checkpoints.integrity import list_checkpoints

    kept = root / CUT_OFF_DIR
    if not kept.is_dir():
        return None
    found = sorted((step, Path(path)) for d in kept.iterdir() if d.is_dir() for step, path in list_checkpoints(d))
    newest = list_checkpoints(root)
    placed = None
    if found and (not newest or found[-1][0] > newest[-1][0]):
        step, path = found[-1]
        placed = root / path.name
        try:
            path.rename(placed)  # refused when a checkpoint of that step appeared meanwhile (or on Windows, exists)
        except OSError:
            placed = None
    shutil.rmtree(kept, ignore_errors=True)
    return placed


class Launcher:
    """One launch: the run directory, the job's records and events, its supervisor and its fault clock."""

    def __init__(self, opts: LaunchOptions) -> None:
        self.o = opts
        self.cfg = opts.config
        self.out = opts.out
        self.records = StepRecords()
        """The merged step records (those kept by ``resume`` too), with their write times ``t``."""
        self.t0 = self._prepare_out()
        """When the run began (an interrupted run's time goes on)."""
        self.written = self.records.committed() - 1
        """The last step written to ``metrics.jsonl`` as the job runs."""
        self.tail = JsonlTail()
        self.epochs = LogEpochs()
        self._clock0 = (time.time(), time.monotonic())
        self.events = EventLog(self.out / "events.jsonl")
        self.metrics = JsonlWriter(self.out / "metrics.jsonl")
        self.display = ProgressDisplay(self.cfg.training.steps, self.written + 1, title=opts.title,
                                       enabled=opts.progress)
        self.supervisor = Supervisor(opts, self.events, self.display.message)
        self.clock = None if opts.random_mtbf_s is None else FaultClock(
            opts.random_mtbf_s, opts.random_faults, self.cfg.parallel.procs_per_replica,
            self.cfg.fault_tolerance.min_replicas, opts.seed)
        self.last_step_at: dict[int, float] = {}
        """replica -> when a step record of it was last read (it is a training member)."""
        self.seen_events: list[dict[str, Any]] = []
        """Every record of ``events.jsonl`` read so far (the live goodput reads them)."""
        self.stop_signal: int | None = None
        """The signal (SIGTERM, SIGINT, SIGHUP) that asked for a graceful stop, once one did."""
        self.stop_started: float | None = None
        self.script_steps: int | None = None
        """The step count a script's ``job.steps(N)`` gave the job, once one did."""
        self.script_error: dict[str, Any] | None = None
        """The ``script_error`` event that stopped the job (the same exception raised again), if one did."""
        self.final_saves: dict[int, tuple[float, int]] = {}
        """replica -> (when, step): the checkpoint the job ends with that it is writing (``checkpoint_final``)."""
        self.save_ended = 0.0
        """When a final checkpoint was last written: the exit grace counts from then too."""
        self.skipped_saves: list[str] = []
        """The lines of periodic checkpoints skipped because the previous one was still being written."""
        self.save_cut: str | None = None
        """The line of a final checkpoint killed mid-write after ``training.checkpoint_timeout_s``, once one was."""
        self.start_failed: str | None = None
        """Why the job could not start (too few replicas left before the first generation), once so."""
        self.goodput_at, self.goodput_line = 0.0, None
        self.wall_s = 0.0
        self.all_lost = False
        """Whether the job ended because every replica was fenced or killed with none to come back."""
        self.rescued: Path | None = None
        """The checkpoint a cut-off replica kept that became the newest complete one (:func:`rescue`), if one did."""
        self.token: str | None = None
        """The coordinator's token, kept to be written again if the run directory is removed."""
        self.run_dir_lost = False
        """Whether the run directory was removed and could not be created again (the job then stops)."""

    def _prepare_out(self) -> float:
        """The run directory; with ``resume``, the step records before the newest checkpoint are kept.
        Returns when the run began."""
        from recover.observe.events import read_jsonl, records_before
        from recover.train.checkpoints.integrity import list_checkpoints, remove_leftovers

        for sub in ("logs", "replicas"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.out / "checkpoints")  # what interrupted saves left (no process runs yet)
        old_logs = sorted((self.out / "replicas").glob("*.jsonl"))
        kept: dict[int, dict[str, Any]] = {}
        lost: list[int] = []
        if self.o.resume:  # the records before the checkpoint: metrics.jsonl's, completed from the replicas' logs
            rescue(self.out / "checkpoints")
            found = list_checkpoints(self.out / "checkpoints")
            before = found[-1][0] if found else 0
            kept, lost = recover_rows(records_before(self.out / "metrics.jsonl", before),
                                      (rec for path in old_logs for rec in read_jsonl(path)), before)
            if lost:
                print(f"recover: warning: the records of committed steps {_ranges(lost)} are lost (metrics.jsonl "
                      "torn and no replica log holds them); the steps are in the checkpoint, their records stay "
                      "missing from metrics.jsonl", file=sys.stderr, flush=True)
        for stale in ["metrics.jsonl", "summary.json", *(p.relative_to(self.out) for p in old_logs)]:
            (self.out / stale).unlink(missing_ok=True)
        if not self.o.resume:
            (self.out / "events.jsonl").unlink(missing_ok=True)
        write_run_config(self.cfg, self.out)
        t0 = time.time() - max((rec["elapsed_s"] for rec in kept.values()), default=0.0)  # time goes on
        for rec in kept.values():
            self.records.add({**rec, "t": t0 + rec["elapsed_s"]})
        self.records.mark_lost(lost)
        return t0

    def run(self) -> int:
        """Runs the job to its end; returns its exit status (see the module docstring)."""
        for step in range(self.written + 1):
            if step not in self.records.lost:
                self.metrics.write(metrics_row(self.records.record(step), self.t0))
        started = time.time()
        self.events.event(Event.LAUNCH, replicas=self.cfg.parallel.replicas, steps=self.cfg.training.steps,
                          failures=[str(s) for s in self.o.failures], random_mtbf_s=self.o.random_mtbf_s,
                          rejoin_after_s=self.o.rejoin_after_s,
                          resume_step=self.written + 1 if self.o.resume else None)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._request_stop)
        try:
            self.supervisor.start()
            self._read_token()
            self._watch()
            self._collect()
            self._flush_metrics(final=True)
        finally:
            self.display.close()
            self.supervisor.kill_all()
            self.supervisor.close()
            self.metrics.close()
        write_metrics(self.out / "metrics.jsonl", self.records, self.t0)  # final: a restart redid some steps
        self.wall_s = time.time() - started
        return self._exit_status()

    def _watch(self) -> None:
        """Until the job ends: stops, processes, records and faults, every :data:`POLL_S`."""
        done_at = None
        while True:
            now = time.time()
            steps = self.cfg.training.steps  # a script's job.steps(N) may set it (_on_script_steps)
            if self.stop_signal is not None and self.stop_started is None:
                self._begin_stop(now)
            self._keep_run_dir()
            self.supervisor.watch_coordinator()
            for rec in self.tail.read(self.out / "events.jsonl"):
                self.seen_events.append(rec)
                self.supervisor.on_event(rec, now)
                self._track_final_save(rec, now)
                if rec.get("kind") == Event.SCRIPT_ERROR:
                    self._on_script_error(rec, now)
                elif rec.get("kind") == Event.SCRIPT_STEPS and self._on_script_steps(int(rec["steps"])):
                    done_at = None
            self.supervisor.reap_fenced(now)
            if self.supervisor.poll(now, self.records.last_step() + 1, unfinished=self.records.committed() < steps):
                self._restart()
            if (why := self.supervisor.cannot_start()) is not None:
                self.start_failed = why
                self.events.event(Event.START_FAILED, message=why)
                return
            self._collect()
            self._flush_metrics(final=False)
            if not self.supervisor.busy():
                return
            if self.stop_started is not None and not self._saving(now) and \
                    now - max(self.stop_started, self.save_ended) > self.cfg.fault_tolerance.stop_grace_s:
                self.events.event(Event.STOP_GRACE_OVER, running=[r.rid for r in self.supervisor.live()])
                return
            if self.records.committed() >= steps:
                # every step committed: the replicas exit on their own (after a final save) within
                # stop_grace_s, joiners with nothing left to join within JOINER_GRACE_S; one still
                # running then (stuck at its exit: a hung thread, a destructor) is stopped by the end
                done_at = done_at or now
                live = self.supervisor.live()
                joiners = all(r.joined for r in live)
                grace = JOINER_GRACE_S if joiners else self.cfg.fault_tolerance.stop_grace_s
                if not self._saving(now) and now >= max(done_at, self.save_ended) + grace:
                    if not joiners:
                        self.events.event(Event.EXIT_GRACE_OVER, running=[r.rid for r in live])
                    return
            elif self.stop_started is None:
                self._strike(now)  # faults strike a job that trains, not one that ends
            time.sleep(POLL_S)

    def _keep_run_dir(self) -> None:
        """The run directory removed under the running job: what the launcher owns and the processes it
        starts read is created again (``logs/``, ``replicas/``, ``config.json``, the coordinator's token),
        with one warning line and a ``run_dir_recreated`` event; the job goes on. The records that every
        writer appends reopen at their paths by themselves (:class:`~recover.observe.events.JsonlWriter`),
        and ``metrics.jsonl`` is written whole at the end from the records the launcher holds."""
        from recover.observe.rundir import write_private

        if self.run_dir_lost or (self.out / "config.json").is_file():
            return
        token = self.token
        try:
            for sub in ("logs", "replicas"):
                (self.out / sub).mkdir(parents=True, exist_ok=True)
            write_run_config(self.cfg, self.out)
            if token is not None:
                write_private(self.supervisor.addr.token_file, token)
        except OSError as exc:  # stop as on SIGTERM: the replicas save where they can
            self.run_dir_lost = True
            self.stop_signal = self.stop_signal or signal.SIGTERM
            print(f"recover: the run directory {self.out} was removed while the job ran and cannot be created again "
                  f"({exc}); stopping at the next step boundary", file=sys.stderr, flush=True)
            return
        print(f"recover: warning: the run directory {self.out} was removed while the job ran; created again "
              f"(logs/, replicas/, config.json, the token) at step {self.written + 1}: the job goes on, but the "
              "checkpoints, logs and events written before are gone", file=sys.stderr, flush=True)
        self.events.event(Event.RUN_DIR_RECREATED, step=self.written + 1)

    def _read_token(self) -> None:
        """Keeps the coordinator's token (written again should its file be removed)."""
        try:
            self.token = self.supervisor.addr.token_file.read_text(encoding="utf-8")
        except OSError:
            self.token = None

    # ---- the checkpoint a job ends with ------------------------------------------------------
    def _track_final_save(self, rec: dict[str, Any], now: float) -> None:
        """Follows the final checkpoints being written: begun (``checkpoint_final``), then done or refused."""
        r = rec.get("replica")
        if rec.get("kind") == Event.CHECKPOINT_FINAL and r is not None:
            self.final_saves[r] = (now, rec["step"])
        elif rec.get("kind") in (Event.CHECKPOINT, Event.CHECKPOINT_UNSAVED) and r is not None:
            if self.final_saves.pop(r, None) is not None:
                self.save_ended = now
        elif rec.get("kind") == Event.CHECKPOINT_SKIPPED:
            self.skipped_saves.append(rec.get("message", ""))
            if len(self.skipped_saves) == 1:
                self.display.message(f"[yellow]{rec.get('message', '')}[/]")

    def _saving(self, now: float) -> bool:
        """Whether a live replica is writing the checkpoint the job ends with, within
        ``training.checkpoint_timeout_s`` of its start (the exit grace never cuts it short). One past
        it is given up: logged, its line kept in :attr:`save_cut` (the job's status is then 12)."""
        live = {r.rid for r in self.supervisor.live()}
        timeout = self.cfg.training.checkpoint_timeout_s
        for r, (since, step) in list(self.final_saves.items()):
            if r not in live:
                del self.final_saves[r]
            elif now - since > timeout:
                del self.final_saves[r]
                self.save_cut = (f"the checkpoint of step {step} was still being written by replica {r} after "
                                 f"training.checkpoint_timeout_s = {timeout:g} s and was cut short; "
                                 f"{newest_complete(self.out / 'checkpoints')}")
                self.events.event(Event.CHECKPOINT_TIMEOUT, replica=r, step=step, timeout_s=timeout)
                self.events.event(Event.CHECKPOINT_UNSAVED, replica=r, step=step, message=self.save_cut,
                                  source="launcher")
        return bool(self.final_saves)

    # ---- records ---------------------------------------------------------------------------
    def _collect(self) -> None:
        """Merges the step records the replicas appended since the last call, each stamped ``t`` with the
        launcher's monotonic clock (:func:`~recover.launch.records.stamp`; never a replica's wall clock)."""
        for path in sorted((self.out / "replicas").glob("replica_*.jsonl")):
            for rec in self.epochs.mark(path, self.tail.read(path)):
                if isinstance(rec.get("t"), (int, float)):
                    rec["t"] = self._clock0[0] + stamp(rec, self._clock0[1], time.monotonic()) - self._clock0[1]
                if self.records.add(rec) and "replica" in rec:
                    self.last_step_at[rec["replica"]] = time.time()

    def _flush_metrics(self, final: bool) -> None:
        """Writes committed steps in order; a step waits for the next one (so its val_loss can merge)."""
        while (self.written + 1) in self.records and (final or (self.written + 2) in self.records):
            self.written += 1
            if self.written in self.records.lost:
                continue
            row = metrics_row(self.records.record(self.written), self.t0)
            self.metrics.write(row)
            self.display.update(row, self._goodput(final))

    def _goodput(self, final: bool) -> str | None:
        """The job's goodput so far, for the progress display: recomputed for every step while that costs
        little, and for at most 5% of the launcher's time (it reads every record so far)."""
        from recover.observe.goodput import describe, goodput

        now = time.time()
        if final or now >= self.goodput_at:
            rows = [self.records.record(s) for s in range(self.written + 1) if s not in self.records.lost]
            self.goodput_line = describe(goodput(rows, self.seen_events, now=now))
            self.goodput_at = now + 20 * (time.time() - now)
        return self.goodput_line

    # ---- faults, restarts, stops -----------------------------------------------------------
    def _strike(self, now: float) -> None:
        """A random fault, when the fault clock has one due: logged (``kill``), then sent."""
        strike = None if self.clock is None else self.clock.tick(now, self.last_step_at, self.supervisor.unstruck())
        if strike is None:
            return
        self.events.event(Event.KILL, replica=strike.replica, rank=strike.rank, step=self.records.last_step() + 1,
                          phase="random", pid=self.supervisor.pid(strike.replica, strike.rank), source="launcher",
                          fault=strike.fault)
        self.supervisor.strike(strike.replica, strike.rank, strike.signal)

    def _restart(self) -> None:
        """Checkpoint-and-restart: stop everything, relaunch the survivors from the last checkpoint."""
        from recover.train.checkpoints.integrity import list_checkpoints

        survivors = self.supervisor.end_job()
        self._collect()
        found = list_checkpoints(self.out / "checkpoints")
        resume_step = found[-1][0] if found else 0
        lost = self.records.forget_from(resume_step)
        self.written = min(self.written, resume_step - 1)
        self.events.event(Event.JOB_RESTART, survivors=survivors, resume_step=resume_step, lost_steps=len(lost),
                          restart=self.supervisor.restarts)
        if len(survivors) >= self.cfg.fault_tolerance.min_replicas:
            self.supervisor.restart_job(survivors, resume=resume_step > 0)
            self._read_token()

    def _request_stop(self, signum: int, frame: Any) -> None:
        """SIGTERM, SIGINT or SIGHUP: a graceful stop (see the module docstring); the second one: at once."""
        if self.stop_signal is not None:
            raise KeyboardInterrupt(f"signal {signum}")
        self.stop_signal = signum
        if signum == signal.SIGHUP:
            self._off_the_terminal()

    def _off_the_terminal(self) -> None:
        """After a hang-up, what the launcher would print to its terminal (gone with the session) goes to
        ``logs/launcher.log`` instead: the stop's line is still written somewhere."""
        if not any(os.isatty(fd) for fd in (1, 2)):
            return  # redirected: the output still has its reader
        fd = os.open(self.out / "logs" / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for std in (1, 2):
            if os.isatty(std):
                os.dup2(fd, std)
        os.close(fd)

    def _begin_stop(self, now: float) -> None:
        """Passes the stop on: SIGTERM to the coordinator, SIGINT to every worker; no more rejoins or faults."""
        self.stop_started = now
        assert self.stop_signal is not None
        grace = self.cfg.fault_tolerance.stop_grace_s
        self.events.event(Event.STOP_REQUESTED, signal=signal.Signals(self.stop_signal).name, source="launcher",
                          grace_s=grace)
        self.display.message(f"[bold]stopping[/]: at the next step boundary, after a checkpoint (within "
                             f"{grace:g} s; signal again to stop at once)")
        self.supervisor.stop()

    def _on_script_steps(self, steps: int) -> bool:
        """A script's ``job.steps(N)``: N steps are the job's (the launch's ``--steps`` is the built-in
        trainer's); a larger N than the one adopted wins. Returns whether the count changed."""
        from dataclasses import replace

        first, self.script_steps = self.script_steps is None, max(steps, self.script_steps or 0)
        if (not first and steps <= self.cfg.training.steps) or steps == self.cfg.training.steps:
            return False
        if first:
            print(f"recover: note: the script commits {steps} steps (its job.steps({steps})); the launch said "
                  f"{self.cfg.training.steps}: the job is {steps} steps", file=sys.stderr, flush=True)
        self.cfg = replace(self.cfg, training=replace(self.cfg.training, steps=steps))
        self.display.total = steps
        return True

    def _on_script_error(self, rec: dict[str, Any], now: float) -> None:
        """A replica's script raised: its lines now; a recurring exception stops the job (module docstring)."""
        rid, rank = rec.get("replica"), rec.get("rank", 0)
        rep = self.supervisor.replicas.get(rid)
        log = rep.ranks[rank].path if rep is not None and rank < len(rep.ranks) else self.out / "logs"
        who = f"replica {rid}" + (f" rank {rank}" if self.cfg.parallel.procs_per_replica > 1 else "")
        at = f" in step {rec['step']}" if rec.get("step") is not None else " before training"
        if rec.get("recurring"):
            self.script_error = self.script_error or rec
            what = ("a bug in the script, not a fault: the job stops after saving the last committed state; fix it "
                    "and continue with --resume")
        elif self.o.rejoin_after_s is not None:
            what = (f"the others go on without it and it rejoins in {self.o.rejoin_after_s:g} s; the same exception "
                    "again stops the job")
        else:
            what = "the others go on without it; the same exception again stops the job"
        lines = "\n".join(f"    {line}" for line in rec.get("lines", []))
        text = (f"recover: {who} raised {rec.get('type')}{' again' if rec.get('recurring') else ''}{at} at "
                f"{rec.get('place')}: {what}; log: {log}\n{lines}")
        if self.display.live:
            from rich.text import Text

            self.display.console.print(Text(text))
        else:
            print(text, file=sys.stderr, flush=True)
        if rec.get("recurring") and self.stop_started is None:
            self.stop_started = now
            self.events.event(Event.STOP_REQUESTED, source="script_error", replica=rid,
                              grace_s=self.cfg.fault_tolerance.stop_grace_s)
            self.supervisor.stop()

    def _exit_status(self) -> int:
        codes = self.supervisor.exit_codes()
        self.events.event(Event.END, wall_s=round(self.wall_s, 3), exit_codes=codes)
        self.events.close()
        if self.save_cut is not None:
            return EXIT_UNSAVED
        if self.script_error is not None:  # stopped by it, whether or not every step committed
            return EXIT_UNSAVED if EXIT_UNSAVED in codes.values() else EXIT_SCRIPT_ERROR
        if self.written + 1 >= self.cfg.training.steps:
            return EXIT_UNSAVED if EXIT_UNSAVED in codes.values() else 0
        if EXIT_RAISED in codes.values() and not any(status in codes.values() for status in EXIT_ORDER):
            return EXIT_SCRIPT_ERROR  # unfinished, its replicas lost to their scripts' exceptions (shown)
        status = next((status for status in EXIT_ORDER if status in codes.values()), None)
        if status is None and self.stop_signal is None and codes and all(c == LOST for c in codes.values()):
            # every replica fenced or killed and none to come back (no --rejoin-after): nobody saved at the end
            from recover.train.checkpoints.integrity import list_checkpoints

            self.all_lost = True
            self.rescued = rescue(self.out / "checkpoints")
            status = EXIT_QUORUM_LOST if list_checkpoints(self.out / "checkpoints") else EXIT_STATE_LOST
        return status or 1


__all__ = ["LaunchOptions", "Launcher"]
