"""The supervisor of ``recover launch``: it starts the job's processes, watches them and ends them all.

Contract:
- The coordinator and the ``recover worker`` processes are forked from the job's fork server
  (:mod:`recover.launch.forkserver`; started at the first, none for a script job or with ``--no-fork-server``,
  each a new interpreter once it cannot serve, said in one line and a ``fork_server`` event).
- The coordinator starts first, as its own process (a worker's death never takes it down), and is
  started again at once, on the same ports and token, whenever it exits while the job runs (at most
  :data:`MAX_COORDINATOR_RESTARTS` times): the replicas keep their state, reconnect and register
  again, and the new coordinator rebuilds the membership from them (:mod:`recover.coord.state`).
- Every replica is P processes (:class:`~recover.launch.processes.ReplicaProcesses`, torchrun's
  agent for them; commands from :class:`~recover.launch.job.Commands`). Its end is logged
  (``replica_exit``); one lost to a SIGKILL rejoins ``rejoin_after_s`` later while the job is
  unfinished (``rejoin_started``; so does a script's replica that raised for the first time,
  :data:`~recover.train.processes.exits.EXIT_RAISED`): as a warm spare when one runs (:mod:`recover.launch.spares`: the
  ``warm_spares`` spares are started with the replicas, and a new one behind each spare taken; a
  replica keeps its spare's devices; the event says how long the spare waited, ``spare_waited_s``),
  else afresh on its own devices. Rejoins
  go on when every replica is lost (the first back restore the newest checkpoint: total loss is not
  the end of a job), but not once a replica ended the job on purpose (quorum lost, a stop, divergence,
  bad data, no state, a final checkpoint the storage refused: an exit status of :data:`ENDS_JOB`).
- Every replica the coordinator declares dead (fenced, hung, silent: its ``failure_detected`` events,
  fed in by :meth:`Supervisor.on_event`) is gone soon after: its own watchdog ends it
  ``fault_tolerance.fence_exit_s`` after the fence, and one still running a second later (frozen,
  or stuck below Python) is SIGKILLed (``reaped``); it then rejoins like a killed replica.
- A rank SIGKILLed by neither a logged fault (a ``kill`` event naming its PID) nor the supervisor was
  killed from outside (an operator, the OOM killer): logged as a ``kill`` from ``external``; when its
  memory cgroup counted an OOM kill meanwhile (:mod:`recover.launch.oom`), with ``cause`` ``out of
  memory``, its cgroup and its peak memory, and one line (:attr:`Supervisor.oom_lines`).
- A spare that exits by itself is logged (``spare_exit``) and replaced (:data:`~recover.launch.spares.MAX_EXITS`).
- :meth:`Supervisor.kill_all` SIGKILLs and reaps every process the supervisor started that still runs
  (spares included; a stop ends the spares at once);
  the launcher calls it whatever ends the job (with :mod:`recover.lifeline` for the case
  where the launcher itself is killed).
- Checkpoint-and-restart baseline: :meth:`Supervisor.poll` reports a replica lost while the job is
  unfinished; :meth:`Supervisor.end_job` then lets the survivors exit (5 s) and ends everything, and
  :meth:`Supervisor.restart_job` starts a new coordinator and the survivors from a checkpoint.
"""

from __future__ import annotations

import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from recover.coord.operator import tell_died
from recover.errors import RecoverError
from recover.launch import forkserver
from recover.launch.job import Address, Commands, LaunchOptions
from recover.launch.oom import SEE_EVERY_S, MemoryWatch
from recover.launch.processes import (
    LOST,
    Ports,
    ReplicaProcesses,
    Spawned,
    cpu_seconds,
    kill_processes,
    signal_processes,
    spawn,
)
from recover.launch.spares import Devices, SparePool
from recover.names import Baseline, Event
from recover.observe.events import EventLog
from recover.observe.rundir import write_private
from recover.train.processes.exits import (
    EXIT_BAD_DATA,
    EXIT_COORDINATOR_LOST,
    EXIT_DIVERGED,
    EXIT_JOB_FAILED,
    EXIT_NONFINITE,
    EXIT_QUORUM_LOST,
    EXIT_RAISED,
    EXIT_SCRIPT_ERROR,
    EXIT_STATE_LOST,
    EXIT_STOPPED,
    EXIT_UNSAVED,
)

POLL_S = 0.05
DIED_TIMEOUT_S = 2.0
"""How long the launcher tries to tell the coordinator a worker died (its closed connection says it anyway)."""
MAX_SAME_EXITS = 3
"""A replica that failed with the same exit status (other than a SIGKILL or a fence) this many times is not
restarted again: the job goes on without it (or ends, when too few replicas are left to start)."""
MAX_COORDINATOR_RESTARTS = 10
ENDS_JOB = (EXIT_QUORUM_LOST, EXIT_STOPPED, EXIT_COORDINATOR_LOST, EXIT_DIVERGED, EXIT_NONFINITE, EXIT_BAD_DATA,
            EXIT_STATE_LOST, EXIT_UNSAVED, EXIT_SCRIPT_ERROR)
"""A replica's exit statuses that end the job on purpose (each after its line and saves)."""
EXPECTED_EXITS = (0, LOST, EXIT_JOB_FAILED, EXIT_RAISED, *ENDS_JOB, None)
"""A replica's exit codes that tell what happened without its log."""


class Supervisor:
    """The processes of one launch (see the module docstring).

    Args:
        opts: the launch.
        events: the job's ``events.jsonl``, where the supervisor logs what it saw and did.
        say: shows a line to the user.
    """

    def __init__(self, opts: LaunchOptions, events: EventLog, say: Callable[[str], None]) -> None:
        self.o = opts
        self.cmds = Commands(opts)
        self.events = events
        self.say = say
        self.ports = Ports(opts.host)
        """The ports this job's processes bind, held from their choice until the launcher exits."""
        self.addr = self._new_address()
        self.resume = opts.resume
        """Whether the workers start from the newest complete checkpoint."""
        self.coordinator: Spawned | None = None
        self.coordinator_restarts = 0
        self.stopping = False
        """A graceful stop began: no more rejoins, and a coordinator that exits stays down."""
        self.replicas: dict[int, ReplicaProcesses] = {}
        self.devices: dict[int, Devices] = {}
        """replica -> its ranks' devices, once a spare it became brought its own (else the placement's)."""
        self.pool = SparePool(opts.placement.spare_devices(self.cmds.ranks, opts.warm_spares), self._start_spare)
        self.spares_started = 0
        self.rejoin_at: dict[int, float] = {}
        """replica -> when it rejoins."""
        self.restarts = 0
        """Job restarts of the checkpoint-and-restart baseline."""
        self.own_kills: set[int] = set()
        """PIDs the supervisor SIGKILLs itself (the job's end, a reaped replica): no death to tell (:meth:`_died`)."""
        self.known_kills: set[int] = set()
        """PIDs whose SIGKILL is accounted for (a ``kill`` event names them, or the supervisor reaped them)."""
        self.lost_at: dict[int, float] = {}
        """replica -> when the coordinator last declared it dead (``failure_detected``)."""
        self.fenced_at: dict[int, float] = {}
        """replica -> when the supervisor read that the coordinator declared it dead while it ran."""
        self.struck: set[int] = set()
        """PIDs a fault of the launcher already hit."""
        self.ended = False
        """A replica ended the job on purpose (an exit status of :data:`ENDS_JOB`): nothing rejoins."""
        self.formed = False
        """The first generation formed (training began): a replica started later joins, taking the state."""
        self.same_exits: dict[tuple[int, int], int] = {}
        """(replica, exit code) -> how often it ended so (a failure other than a SIGKILL or a fence)."""
        self.memory = MemoryWatch()
        self._memory_at = 0.0
        self.oom_lines: list[str] = []
        """One line per replica the kernel's OOM killer ended (the launcher prints them at the end)."""
        self.given_up: dict[int, int] = {}
        """replica -> the exit code it failed with :data:`MAX_SAME_EXITS` times: not restarted again."""
        self.forks: forkserver.ForkServer | None = None
        """The job's fork server, which the coordinator and ``recover worker`` processes are forked from (None:
        not started yet, or none)."""
        self.forks_ended = False
        """The fork server could not serve (or is off): every process starts as a new interpreter."""

    # ---- starting --------------------------------------------------------------------------
    def start(self) -> None:
        """The coordinator, every replica and the warm spares. The workers start while the coordinator
        starts (their first connection waits for it), so its start-up overlaps theirs. Both are forked
        from the job's fork server, which the coordinator's start waits for (its imports)."""
        self._spawn_coordinator(self.o.config.parallel.replicas)
        for rid in range(self.o.config.parallel.replicas):
            self._start_replica(rid, join=False)
        self.pool.fill()
        self._await_coordinator()

    def _new_address(self) -> Address:
        """Ports and token of a new job's coordinator (a restarted coordinator keeps them)."""
        token_file = self.o.out / "token"
        write_private(token_file, secrets.token_hex(16))
        return Address(self.o.host, self.ports.take("coordinator"), self.ports.take("store"), token_file)

    def _start_coordinator(self, expected: int) -> None:
        self._spawn_coordinator(expected)
        self._await_coordinator()

    def _spawn_coordinator(self, expected: int) -> None:
        cmd = self.cmds.coordinator(self.addr, expected, first=not self.coordinator_restarts)
        self.coordinator = spawn(cmd, self.o.out / "logs" / "coordinator.log", {}, forks=self._forks())
        self._forks_checked()

    def _await_coordinator(self) -> None:
        """Until the coordinator listens; it must not exit meanwhile."""
        assert self.coordinator is not None
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.coordinator.proc.poll() is not None:  # its last line says why (a taken port: which, the fix)
                self.coordinator.log.flush()
                said = [line for line in self.coordinator.path.read_text(errors="replace").splitlines() if line]
                raise RecoverError(f"the coordinator exited with {self.coordinator.proc.returncode} "
                                   f"({said[-1] if said else 'no output'}); see {self.coordinator.path}")
            try:
                socket.create_connection((self.o.host, self.addr.port), timeout=0.2).close()  # type: ignore[arg-type]
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the coordinator did not start listening within 30 s")

    def _spawn(self, cmd: list[str], name: str, devices: Devices, stdin: Any = None,
               extra_env: dict[str, str] | None = None) -> list[Spawned]:
        """The P processes of one replica or spare, each in its own session on its device; P > 1 get
        torchrun's environment."""
        P = self.cmds.ranks
        port = self.ports.take(name) if P > 1 else 0  # its ranks' own store (rank 0's)
        logs = self.o.out / "logs"
        forks = self._forks() if cmd[1:3] == ["-m", "recover"] else None  # not a user's script
        spawned = [spawn(cmd, logs / (f"{name}.log" if P == 1 else f"{name}_rank{k}.log"),
                         {**self.cmds.env(devices[k], k, port), **(extra_env or {})}, stdin, on_death=self._died,
                         forks=forks)
                   for k in range(P)]
        self._forks_checked()
        return spawned

    def _forks(self) -> forkserver.ForkServer | None:
        """The fork server, started at the first request (None: processes start as new interpreters; so do a
        script job's, whose replicas are the user's command: one coordinator is not worth the server's imports)."""
        if self.forks is None and self.o.fork_workers and not self.o.script and not self.forks_ended:
            self.forks = forkserver.start(self.o.out / "logs" / "forkserver.log")
            self.forks_ended = self.forks is None
        return self.forks

    def _forks_checked(self) -> None:
        """A fork server that could not serve is said once; every process after starts afresh."""
        if self.forks is not None and self.forks.broken is not None:
            self.say(f"recover: note: the job's processes start as new interpreters: the fork server cannot "
                     f"serve: {self.forks.broken} (see {self.o.out / 'logs' / 'forkserver.log'})")
            self.events.event(Event.FORK_SERVER, forks=False, why=self.forks.broken)
            self.forks.close()
            self.forks, self.forks_ended = None, True

    def _died(self, pid: int) -> None:
        """(a death watch's thread) A worker process died: the coordinator is told at once, before the process's
        connection closes (the kernel closes it only once the process's memory is torn down, 25-40 ms later
        for a torch process). Unreachable or not in time: its connection closing tells it all the same. A process
        the supervisor killed itself (the job's end, a reaped replica) is no news."""
        if pid in self.own_kills:
            return
        try:
            token = self.addr.token_file.read_text().strip()
        except OSError:
            return
        tell_died(f"{self.addr.host}:{self.addr.port}", token, pid, self.o.tls, timeout_s=DIED_TIMEOUT_S)

    def _start_spare(self, devices: Devices) -> list[Spawned]:
        """A warm spare on ``devices``: a replica's workers that start up (torch, model, data) and wait on
        stdin to be told who to be."""
        name = f"spare_{self.spares_started}"
        self.spares_started += 1
        return self._spawn([*self.cmds.worker(self.addr, self.resume), "--spare"], name, devices,
                           stdin=subprocess.PIPE)

    def devices_of(self, rid: int) -> Devices:
        """The devices replica ``rid`` runs on (a replica started afresh takes them again)."""
        return self.devices.get(rid) or self.o.placement.devices(rid, self.cmds.ranks)

    def _start_replica(self, rid: int, join: bool) -> None:
        again = rid in self.replicas  # a restart before the first generation does not join: it is a member
        spare = self.pool.take(self.devices_of(rid)) if join else None
        waited: dict[str, float] = {}
        if spare is not None:
            spare.order(self.cmds.spare_order(rid))
            ranks, self.devices[rid] = spare.ranks, spare.devices
            waited = {"spare_waited_s": round(time.time() - spare.started, 3)}
        elif self.o.script:
            env = self.cmds.script_env(self.addr, self.resume, rid, join)
            ranks = self._spawn(list(self.o.script), f"replica_{rid}", self.devices_of(rid), extra_env=env)
        else:
            ranks = self._spawn(self.cmds.replica(self.addr, self.resume, rid, join), f"replica_{rid}",
                                self.devices_of(rid))
        self.replicas[rid] = ReplicaProcesses(rid, ranks, time.time(), join)
        self.fenced_at.pop(rid, None)  # a fence of the process this one replaces: never this one's to reap
        for rank in ranks:
            self.memory.see(rank.proc.pid)
        if join or (again and not self.formed):
            self.events.event(Event.REJOIN_STARTED, replica=rid, pid=ranks[0].proc.pid, log=ranks[0].path.name,
                              join=join, **waited)

    # ---- watching --------------------------------------------------------------------------
    def live(self) -> list[ReplicaProcesses]:
        """The replicas still running."""
        return [r for r in self.replicas.values() if r.exit_code is None]

    def busy(self) -> bool:
        """Whether a replica runs or is due to rejoin."""
        return bool(self.live() or self.rejoin_at)

    def watch_coordinator(self) -> None:
        """A coordinator that exited while the job runs is started again on its ports and token."""
        if self.coordinator is None or self.coordinator.proc.poll() is None or self.stopping:
            return
        code = self.coordinator.proc.returncode
        if self.coordinator_restarts >= MAX_COORDINATOR_RESTARTS:
            raise RuntimeError(f"the coordinator exited ({code}) {self.coordinator_restarts + 1} times; see "
                               f"{self.coordinator.path}")
        self.coordinator_restarts += 1
        self.events.event(Event.COORDINATOR_EXIT, code=code, restart=self.coordinator_restarts)
        self.say(f"coordinator exited ({code}): restarting it; replicas keep their state")
        self.coordinator.log.close()
        self._start_coordinator(self.o.config.parallel.replicas)

    def on_event(self, rec: dict[str, Any], now: float) -> None:
        """Takes in one record of ``events.jsonl``: injected faults that struck, kills accounted for, and
        replicas declared dead."""
        if rec.get("spec") is not None:  # an injected fault struck: a restarted replica is not given it again
            self.cmds.struck.add(rec["spec"])
        if rec.get("kind") == "generation":
            self.formed = True
        if rec.get("kind") == "kill" and rec.get("pid") is not None:
            self.known_kills.add(rec["pid"])
        elif rec.get("kind") == "failure_detected":
            self.lost_at[rec["replica"]] = rec["t"]
            rep = self.replicas.get(rec["replica"])
            if rec.get("cause") != "left" and rep is not None and rep.exit_code is None and rep.started <= rec["t"]:
                self.fenced_at.setdefault(rep.rid, now)

    def reap_fenced(self, now: float) -> None:
        """A replica the coordinator declared dead (fenced, hung, silent) that still runs ``fence_exit_s``
        + 1 s later is SIGKILLed: a hung or frozen process cannot be trusted to exit by itself."""
        grace = self.o.config.fault_tolerance.fence_exit_s + 1.0
        for rid, since in list(self.fenced_at.items()):
            rep = self.replicas.get(rid)
            if rep is None or rep.exit_code is not None or not rep.running():
                del self.fenced_at[rid]  # gone by itself: poll logs its exit
            elif now - since >= grace:
                del self.fenced_at[rid]
                self.events.event(Event.REAPED, replica=rid, pids=[p.pid for p in rep.procs],
                                  after_s=round(now - since, 3))
                self.known_kills.update(p.pid for p in rep.procs)  # the supervisor's own SIGKILL: no kill event
                self.own_kills.update(p.pid for p in rep.procs)
                rep.kill()

    def poll(self, now: float, step: int, unfinished: bool) -> bool:
        """Logs the replicas that ended, schedules their rejoins and starts those due.

        Args:
            now: the time, seconds.
            step: the step training is at (the first not committed), for the events.
            unfinished: whether steps remain to be committed (nothing rejoins a finished job).

        Returns:
            True when the checkpoint-and-restart baseline must restart the job (see :meth:`end_job`).
        """
        for rep in self.replicas.values():
            if rep.exit_code is not None or (code := rep.poll()) is None:
                continue
            rep.close_logs()
            self._count_external_kill(rep, now, step)
            self.events.event(Event.REPLICA_EXIT, replica=rep.rid, code=code, pid=rep.pid,
                              **({"rank_codes": rep.codes} if self.cmds.ranks > 1 else {}))
            if self.o.baseline == Baseline.RESTART and code in (-signal.SIGKILL, EXIT_JOB_FAILED) and unfinished:
                return True
            self.ended = self.ended or code in ENDS_JOB
            if self._failed(rep.rid, code, unfinished) and self.o.rejoin_after_s is not None and (
                    self.o.rejoin_replicas is None or rep.rid in self.o.rejoin_replicas):
                self.rejoin_at[rep.rid] = now + self.o.rejoin_after_s
        if now >= self._memory_at:  # the running ranks' memory cgroups and peaks, to name an OOM kill
            self._memory_at = now + SEE_EVERY_S
            for pid in (p.pid for r in self.live() for p in r.procs):
                self.memory.see(pid)
        for spare in self.pool.reap():
            self.events.event(Event.SPARE_EXIT, codes=[r.proc.returncode for r in spare.ranks],
                              log=spare.ranks[0].path.name, replaced=not self.pool.gave_up)
        for rid, when in list(self.rejoin_at.items()):
            if self.ended or not unfinished:  # nothing to join
                del self.rejoin_at[rid]
            elif now >= when:
                del self.rejoin_at[rid]
                self._start_replica(rid, join=self.formed)  # before the first generation: one of its members
        return False

    def _failed(self, rid: int, code: int, unfinished: bool) -> bool:
        """Whether replica ``rid``'s exit with ``code`` is a failure to restart it after: any exit of an
        unfinished job that was neither a finish or leave (0) nor an end on purpose, unless it failed the
        same way (not a SIGKILL or fence: those come from outside) :data:`MAX_SAME_EXITS` times."""
        if not unfinished or self.stopping or code in (0, EXIT_JOB_FAILED, *ENDS_JOB):
            return False
        if code == LOST:
            return True
        seen = self.same_exits[rid, code] = self.same_exits.get((rid, code), 0) + 1
        if seen < MAX_SAME_EXITS:
            return True
        self.given_up[rid] = code
        self.events.event(Event.REPLICA_GIVEN_UP, replica=rid, code=code, exits=seen)
        self.say(f"replica {rid} exited with {code} {seen} times: not restarted again")
        return False

    def cannot_start(self) -> str | None:
        """Before the first generation: why the job cannot start (fewer replicas left, running or due to
        restart, than ``fault_tolerance.min_replicas``, after a failure), else None."""
        need = self.o.config.fault_tolerance.min_replicas
        left = len(self.live()) + len(self.rejoin_at)
        failed = [r for r in self.replicas.values() if r.exit_code not in (None, 0)]
        if self.formed or not failed or left >= need:
            return None
        first = failed[0]
        return (f"replica {first.rid} exited with {first.exit_code} before training began, and {left} replica(s) are "
                f"left of the {need} needed (fault_tolerance.min_replicas); its log: {first.ranks[0].path}")

    def _count_external_kill(self, rep: ReplicaProcesses, now: float, step: int) -> None:
        """A rank SIGKILLed by neither the fault injection nor the supervisor was killed from outside (an
        operator, the OOM killer, a test): logged as a kill, timed from when the coordinator saw it go."""
        killed = [rep.procs[k].pid for k, c in rep.codes.items() if c == -signal.SIGKILL]
        if killed and not self.known_kills & {p.pid for p in rep.procs}:
            at = self.lost_at.get(rep.rid)
            oom = next((o for o in map(self.memory.oom, killed) if o is not None), None)
            cause = {} if oom is None else {"cause": "out of memory", "cgroup": oom.cgroup,
                                            "peak_bytes": oom.peak_bytes}
            self.events.event(Event.KILL, replica=rep.rid, step=step, phase="external", pid=killed[0],
                              source="external", at=at if at is not None and at >= rep.started else now, **cause)
            self.known_kills.update(killed)
            if oom is not None:
                line = f"recover: replica {rep.rid} (PID {killed[0]}) was killed at step {step}: {oom.describe()}"
                self.oom_lines.append(line)
                self.say(line)
        for proc in rep.procs:
            self.memory.forget(proc.pid)

    # ---- acting ----------------------------------------------------------------------------
    def pid(self, rid: int, rank: int) -> int:
        """The PID of rank ``rank`` of replica ``rid``."""
        return self.replicas[rid].procs[rank].pid

    def strike(self, rid: int, rank: int, sig: int) -> None:
        """Sends ``sig`` to rank ``rank`` of replica ``rid`` (a fault: that process is not struck again)."""
        pid = self.pid(rid, rank)
        self.struck.add(pid)
        signal_processes([self.replicas[rid].procs[rank]], sig)

    def unstruck(self) -> dict[int, float]:
        """The running replicas no fault of the launcher hit yet -> when their processes started."""
        return {r.rid: r.started for r in self.live() if not any(p.pid in self.struck for p in r.procs)}

    def stop(self) -> None:
        """A graceful stop: no more rejoins, the spares end, SIGTERM to the coordinator and SIGINT to every
        worker (SIGINT stops the job; SIGTERM to a worker would be its leave alone)."""
        self.stopping = True
        self.rejoin_at.clear()
        self.pool.close()
        signal_processes([p for r in self.live() for p in r.procs], signal.SIGINT)
        if self.coordinator:
            signal_processes([self.coordinator.proc], signal.SIGTERM)

    def end_job(self) -> list[int]:
        """Checkpoint-and-restart: lets the survivors notice and exit (5 s, as a failed torchrun job does),
        then ends every process; returns the surviving replicas."""
        deadline = time.time() + 5.0
        while time.time() < deadline and any(r.running() for r in self.replicas.values()):
            time.sleep(POLL_S)
        survivors = sorted(r.rid for r in self.replicas.values() if r.poll() != LOST)
        self.restarts += 1
        self.kill_all()
        self.coordinator = None  # ended on purpose: not one to restart
        for rep in self.replicas.values():
            if rep.exit_code is None:
                rep.poll()
                rep.close_logs()
        return survivors

    def restart_job(self, survivors: list[int], resume: bool) -> None:
        """Checkpoint-and-restart: a new coordinator (new ports and token) and the survivors, from the
        newest checkpoint when ``resume``."""
        self.resume = resume
        self.addr = self._new_address()
        self._start_coordinator(len(survivors))
        for rid in survivors:
            self._start_replica(rid, join=False)

    def kill_all(self) -> None:
        """SIGKILLs and reaps every process started that still runs (spares, replicas, coordinator)."""
        self.pool.close()
        procs = [p for r in self.replicas.values() for p in r.procs]
        self.own_kills.update(p.pid for p in procs)
        if self.coordinator and self.coordinator.proc.poll() is None:  # what it spent (coordinator_start: from)
            self.events.event(Event.COORDINATOR_ENDED, cpu_s=cpu_seconds(self.coordinator.proc.pid))
        kill_processes(procs + ([self.coordinator.proc] if self.coordinator else []))

    def close(self) -> None:
        """Ends the fork server (after :meth:`kill_all`), logging what it did (``fork_server``)."""
        self.forks_ended = True
        if self.forks is not None:
            ready = self.forks.ready or {}
            self.events.event(Event.FORK_SERVER, forks=True, forked=self.forks.forked, cpu_s=ready.get("cpu_s"),
                              threads=ready.get("threads"))
            self.forks.close()
            self.forks = None

    # ---- the end ---------------------------------------------------------------------------
    def exit_codes(self) -> dict[int, int | None]:
        """replica -> its exit code (None: still running)."""
        return {r.rid: r.exit_code for r in self.replicas.values()}

    def failed_logs(self) -> list[str]:
        """Tails of logs of replicas that exited with an error (not a SIGKILL or quorum loss)."""
        out = []
        for rep in self.replicas.values():
            if rep.exit_code in EXPECTED_EXITS:
                continue
            for k, rank in enumerate(rep.ranks):
                if rep.codes.get(k, 0) != 0:
                    text = rank.path.read_text(errors="replace")
                    who = f"replica {rep.rid}" + (f" rank {k}" if len(rep.ranks) > 1 else "")
                    out.append(f"{who} exited with {rep.codes[k]}:\n" + "\n".join(text.splitlines()[-15:]))
        return out


__all__ = ["Supervisor"]
