"""``recover coordinator``: run the coordinator service (and the c10d store) in the foreground.

Contract: start it before the replicas; it binds 127.0.0.1 unless ``--host`` says otherwise (the
replicas are told to reach its store at ``--advertise-host``, by default that address), reads
the shared token from ``--token-file`` (never from the command line, which other users can see),
prints one ``ready`` line with both ports, and serves until interrupted. Replica ids ``0..N-1`` of
``--max-replicas N`` (default ``--replicas``) are admitted; any other register is refused. With
``--tls-cert/--tls-key/--tls-ca`` the wire is TLS, every worker presenting a certificate signed by the
CA (:mod:`recover.coord.tls`).

Metrics: ``--metrics-port P`` serves the job's state in Prometheus' text format at
``http://HOST:P/metrics`` (generation, members, live replicas, committed step, failures by cause,
goodput, step seconds: :mod:`recover.observe.jobmetrics`); ``--tensorboard DIR`` writes the job's
TensorBoard run there (generation, members, step time, goodput, faults as text).

SIGTERM or SIGINT stops the job gracefully: the next commit is a stop (every replica finishes that
step, the lowest saves a complete checkpoint, all exit), and the coordinator exits once every replica
is gone. A second signal stops it at once; one within :data:`SAME_REQUEST_S` of the first is the same
request (a Slurm time limit or preemption signals every process of the job at once, this one and the
batch script that passes its own on).

Settings: ``--config RUN/config.json`` (what ``recover launch`` passes) reads the quorum, heartbeat, hang and
connection settings and the replica layout from the run's config, as the workers do; each of those flags
given overrides its field (a coordinator started by hand needs no config: the flags' defaults apply). They
are resolved once, into one :class:`Settings`.
Run directory: with ``--lease DIR`` the coordinator holds DIR's lease while it runs
(:mod:`recover.observe.lease`; the recipes' run directory): a second job on DIR is refused in one line
naming the holder; a coordinator of this host that died is taken over at once (its restart), one of
another host once it stopped renewing (a job requeued elsewhere waits for that, at most 40 s).

Restart: if the coordinator dies while a job runs, start it again with the same flags (same
``--port`` and ``--store-port``): the replicas, which keep their state and retry for
``fault_tolerance.coordinator_reconnect_s``, register again with what they hold and it rebuilds
the membership from them (``recover launch`` does this by itself).

``recover drain R --coordinator HOST:PORT --token-file F`` asks a running coordinator to drain replica
R: it leaves at the next commit as on SIGTERM to it (its share of that step is in it; it saves nothing
and exits 0), the others train on in a generation formed without it, and the command prints one line,
``drained at step S``, or the refusal (not a member, or the members left would fall below
``--min-replicas``: stop the job instead) with exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recover.coord.tls import Tls, add_tls_flags
from recover.errors import ConfigError

SAME_REQUEST_S = 2.0
"""Stop signals this soon after the first are the same request, not the second that stops at once."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("coordinator", help="run the membership coordinator and rendezvous store",
                              description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="the address the replicas reach this coordinator and its store at (default: --host, or "
                        "this machine's name when --host is 0.0.0.0 or ::); e.g. a Kubernetes Service's DNS name")
    p.add_argument("--port", type=int, default=29400, help="service port (0 picks a free one)")
    p.add_argument("--store-port", type=int, default=0, help="c10d TCPStore port (0 picks a free one)")
    p.add_argument("--token-file", required=True, help="file holding the shared registration token")
    p.add_argument("--events", default=None, help="events.jsonl to append membership changes to")
    p.add_argument("--config", default=None, metavar="RUN/config.json",
                   help="the run's config: the settings below default to its fields (the flags override them)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas that form the first generation (default: parallel.replicas, else 1)")
    p.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="replica ids admitted: 0..N-1 (default: --replicas); a register beyond is refused")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="quorum; fewer live replicas is logged (default: fault_tolerance.min_replicas, else 1)")
    p.add_argument("--heartbeat-interval", type=float, default=None,
                   help="seconds between heartbeats, at least: raised for large jobs (recover.coord.scale) "
                        "(default: fault_tolerance.heartbeat_interval_s, else 0.1)")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="silence (s) that marks a replica dead, at least (follows the heartbeat interval) "
                        "(default: fault_tolerance.heartbeat_timeout_s, else 1.0)")
    p.add_argument("--ranks-per-replica", type=int, default=None,
                   help="processes per replica (default: parallel's pp x fsdp x tp, else 1)")
    p.add_argument("--connections", choices=("rank", "replica"), default=None,
                   help="one coordinator connection per rank, or per replica through its relay (default: "
                        "fault_tolerance.connections, else rank)")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="no progress (s) while others wait that marks a replica hung; 0: from the step time "
                        "(default: fault_tolerance.hang_timeout_s, else 0)")
    p.add_argument("--lease", default=None, metavar="DIR",
                   help="hold the run directory DIR's lease while the coordinator runs (renewed every 5 s): a second "
                        "job on DIR is refused; one of another host that stopped renewing it 30 s ago is taken over "
                        "(waited for up to 40 s)")
    p.add_argument("--lease-job", default=None, metavar="ID",
                   help="the job this coordinator belongs to, as its scheduler names it (a Kubernetes Deployment, a "
                        "Slurm job id): a lease held by the same job is its earlier coordinator, which the scheduler "
                        "replaced, and is taken over at once")
    p.add_argument("--start-timeout", type=float, default=None, metavar="S",
                   help="the first generation waits at most S seconds after the first registration for the other "
                        "--replicas, then forms of those registered (at least --min-replicas; default: "
                        "fault_tolerance.start_timeout_s, else 60)")
    p.add_argument("--slow-link-factor", type=float, default=None, metavar="F",
                   help="fence a replica whose link makes the step more than F x the step estimated without it "
                        "(recover.coord.graylinks; 0: off; default: fault_tolerance.slow_link_factor, else 1.5)")
    p.add_argument("--slow-link-steps", type=int, default=None, metavar="K",
                   help="communication-bound commits in a row before the links are probed (default: "
                        "fault_tolerance.slow_link_steps, else 3)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics (HOST: --host); 0: off (default)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write the job's TensorBoard run into DIR (e.g. RUN_DIR/tensorboard/job)")
    p.add_argument("--die-at-commit", default=None, metavar="STEP[:SENT]", help=argparse.SUPPRESS)
    add_tls_flags(p)
    p.set_defaults(func=run)

    d = subparsers.add_parser("drain", help="make one replica of a running job leave at its next step boundary",
                              description="Ask the coordinator of a running job to drain replica R: it leaves at "
                                          "the next commit (its share of that step is in it; it saves nothing and "
                                          "exits 0) and the others train on without it. Prints `drained at step S` "
                                          "or the refusal. Once accepted, the drain stands: Ctrl-C or --timeout ends "
                                          "only the wait.")
    d.add_argument("replica", type=int, metavar="R", help="the replica id to drain")
    d.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the job's coordinator")
    d.add_argument("--token-file", required=True, help="the file holding the job's token")
    d.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="how long to wait for the step boundary it leaves at (default 600 s)")
    add_tls_flags(d)
    d.set_defaults(func=run_drain)


@dataclass(frozen=True)
class Settings:
    """The coordinator's settings (see the module docstring): the defaults of a coordinator started by hand."""

    replicas: int = 1
    max_replicas: int | None = None
    min_replicas: int = 1
    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    hang_timeout_s: float = 0.0
    ranks_per_replica: int = 1
    connections: str = "rank"
    start_timeout_s: float = 60.0
    slow_link_factor: float = 1.5
    slow_link_steps: int = 3

    @classmethod
    def of(cls, args: argparse.Namespace) -> Settings:
        """``--config``'s fields, then every flag given. Raises ConfigError (one line) for an unreadable config
        or a setting that is not allowed."""
        base = cls()
        if getattr(args, "config", None):
            from recover.config import load_config

            cfg = load_config(args.config)
            ft, p = cfg.fault_tolerance, cfg.parallel
            base = cls(p.replicas, None, ft.min_replicas, ft.heartbeat_interval_s, ft.heartbeat_timeout_s,
                       ft.hang_timeout_s, p.procs_per_replica, ft.connections, ft.start_timeout_s,
                       ft.slow_link_factor, ft.slow_link_steps)
        flags = {"replicas": args.replicas, "max_replicas": args.max_replicas, "min_replicas": args.min_replicas,
                 "heartbeat_interval_s": args.heartbeat_interval, "heartbeat_timeout_s": args.heartbeat_timeout,
                 "hang_timeout_s": args.hang_timeout, "ranks_per_replica": args.ranks_per_replica,
                 "connections": args.connections, "start_timeout_s": args.start_timeout,
                 "slow_link_factor": getattr(args, "slow_link_factor", None),
                 "slow_link_steps": getattr(args, "slow_link_steps", None)}
        settings = replace(base, **{k: v for k, v in flags.items() if v is not None})
        settings.check()
        return settings

    def check(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigError(f"--max-replicas ({self.max_replicas}) must be >= --replicas ({self.replicas})")
        if self.ranks_per_replica < 1:
            raise ConfigError(f"--ranks-per-replica must be >= 1, got {self.ranks_per_replica}")
        if self.hang_timeout_s < 0:
            raise ConfigError(f"--hang-timeout must be >= 0 seconds (0: from the step time), got {self.hang_timeout_s}")
        if self.start_timeout_s <= 0:
            raise ConfigError(f"--start-timeout must be > 0 seconds, got {self.start_timeout_s}")
        if not (self.slow_link_factor == 0 or self.slow_link_factor > 1):
            raise ConfigError(f"--slow-link-factor must be > 1 (0: off), got {self.slow_link_factor}")
        if self.slow_link_steps < 1:
            raise ConfigError(f"--slow-link-steps must be >= 1, got {self.slow_link_steps}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"--heartbeat-timeout ({self.heartbeat_timeout_s}) must exceed "
                              f"--heartbeat-interval ({self.heartbeat_interval_s})")


def read_token(path: str, warn: bool = False) -> str:
    """The token in ``path`` (surrounding whitespace stripped); ``warn``: a file other users can read is named in
    one warning line (the coordinator's: it admits whoever presents the token). Raises ConfigError if unusable."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"--token-file {path!r} cannot be read ({exc.strerror}); "
                          "write a secret into it, e.g. `openssl rand -hex 16 > token`") from None
    if not token:
        raise ConfigError(f"--token-file {path!r} is empty; write a secret into it")
    mode = Path(path).stat().st_mode & 0o777
    # (a mounted Kubernetes Secret is a symlink into the pod's own volume: its mode is the volume's)
    if warn and mode & 0o077 and not Path(path).is_symlink():
        print(f"recover: warning: --token-file {path} is readable by other users (mode {mode:o}): anyone who can "
              f"read it can register a replica; chmod 600 {path}", file=sys.stderr)
    return token


def bind_failure(host: str, port: int, flag: str, exc: BaseException) -> str:
    """The one line of a port the coordinator could not bind: which, why, and the fix."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EADDRNOTAVAIL or "assign requested address" in text:
        return (f"cannot bind {host}:{port} ({flag}): {host} is no address of this machine; give --host an address "
                "it has (0.0.0.0: all of them)")
    if isinstance(exc, OSError) and exc.errno == errno.EACCES or "ermission denied" in text:
        return f"cannot bind {host}:{port} ({flag}): ports below 1024 need privileges; give {flag} 1024 or above"
    why = "another process holds it" if "in use" in text or (isinstance(exc, OSError) and
                                                              exc.errno == errno.EADDRINUSE) else text
    return (f"cannot bind {host}:{port} ({flag}): {why}; give another {flag} (0 picks a free one), or end the "
            f"process holding it (`ss -ltnp 'sport = :{port}'` names it)")


def parse_die_at_commit(text: str | None) -> tuple[int, int] | None:
    """``STEP[:SENT]`` of the fault injection ``--die-at-commit`` (SENT defaults to 0)."""
    if not text:
        return None
    step, _, sent = text.partition(":")
    try:
        out = int(step), int(sent or 0)
    except ValueError:
        raise ConfigError(f"--die-at-commit {text!r}: expected STEP[:SENT], e.g. 10:1") from None
    if out[0] < 0 or out[1] < 0:
        raise ConfigError(f"--die-at-commit {text!r}: STEP and SENT must be >= 0")
    return out


def run_drain(args: argparse.Namespace) -> int:
    """``recover drain``: one line, ``drained at step S`` (0) or the refusal (a RecoverError: 2)."""
    from recover.coord.operator import ask

    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    tls = Tls.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    t0 = time.monotonic()
    reply = ask(args.coordinator, read_token(args.token_file), {"type": "drain", "replica": args.replica}, tls,
                args.timeout, f"; if the coordinator took the request, replica {args.replica} still leaves at "
                              "its next commit")
    print(f"replica {reply['replica']} drained at step {reply['step']}: generation {reply['generation']} goes on "
          f"without it ({1e3 * (time.monotonic() - t0):.0f} ms after the request)", flush=True)
    return 0


def launch_time(events: str | None) -> float | None:
    """The time of the last ``launch`` event in ``events`` (the launcher's, written before it starts this
    coordinator): where the job's wall time starts for goodput, as ``recover status`` counts it. None: none."""
    from recover.names import Event
    from recover.observe.events import read_jsonl

    if not events or not Path(events).is_file():
        return None
    launches = [e["t"] for e in read_jsonl(events) if e.get("kind") == Event.LAUNCH and isinstance(e.get("t"), float)]
    return launches[-1] if launches else None


def job_metrics(args: argparse.Namespace) -> tuple[Any, Any]:
    """The job's tallies (with its TensorBoard run under ``--tensorboard``) and, with ``--metrics-port``,
    its endpoint, bound (ConfigError: the port is taken) but not yet serving."""
    from recover.observe.jobmetrics import JobMetrics, sample_every
    from recover.observe.prometheus import MetricsServer
    from recover.observe.tensorboard import EventFileWriter

    metrics = JobMetrics(EventFileWriter(args.tensorboard) if args.tensorboard else None,
                         started=launch_time(args.events))
    if metrics.board is not None:
        sample_every(metrics, 10.0)
    endpoint = MetricsServer(args.host, args.metrics_port) if args.metrics_port else None
    return metrics, endpoint


def run(args: argparse.Namespace) -> int:
    from recover.coord.server import Coordinator
    from recover.lifeline import die_with_launcher
    from recover.observe.prometheus import render

    die_with_launcher()  # started by `recover launch`: never outlive it

    st = Settings.of(args)
    lease = None
    if args.lease:  # before anything is written to the run directory (the events go there)
        from recover.observe.lease import RENEW_S, TTL_S, acquire

        lease = acquire(Path(args.lease), "recover coordinator", wait_s=TTL_S + 2 * RENEW_S, job=args.lease_job or "")
        lease.start_renewing()
        if lease.took_over:
            print(f"recover: note: took over {args.lease}'s lease from {lease.took_over}", file=sys.stderr,
                  flush=True)
    metrics, endpoint = job_metrics(args)
    coord = Coordinator(args.host, args.port, token=read_token(args.token_file, warn=True), events_path=args.events,
                        heartbeat_interval_s=st.heartbeat_interval_s, heartbeat_timeout_s=st.heartbeat_timeout_s,
                        store_port=args.store_port, min_members=st.min_replicas,
                        expected_replicas=st.replicas, hang_timeout_s=st.hang_timeout_s,
                        die_at_commit=parse_die_at_commit(args.die_at_commit),
                        ranks_per_replica=st.ranks_per_replica,
                        per_replica_connections=st.connections == "replica",
                        advertise_host=args.advertise_host, max_replicas=st.max_replicas,
                        tls=Tls.from_flags(args.tls_cert, args.tls_key, args.tls_ca), on_event=metrics.on_event,
                        start_timeout_s=st.start_timeout_s, slow_link=(st.slow_link_factor, st.slow_link_steps))
    try:
        coord.start()
    except ConfigError:
        if lease is not None:
            lease.release()
        raise
    except (OSError, RuntimeError) as exc:
        if lease is not None:
            lease.release()
        store_failed = not coord.store_port  # the store binds first: with its port known, the service failed
        raise ConfigError(bind_failure(args.host, args.store_port if store_failed else args.port,
                                       "--store-port" if store_failed else "--port", exc)) from None
    if endpoint is not None:
        endpoint.start(lambda: render(metrics.families(coord.snapshot())))
    asked: list[float] = []  # when a signal asked for the stop

    def stop_job(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if asked and now - asked[0] < SAME_REQUEST_S:
            return  # the same request, sent twice
        if coord.state is None or coord.state.stop_requested or not coord.state.live:
            raise KeyboardInterrupt(f"signal {signum}")  # the second one, or no job to stop: at once
        asked.append(now)
        coord.request_stop()

    signal.signal(signal.SIGTERM, stop_job)  # before the ready line: whoever read it may signal at once
    signal.signal(signal.SIGINT, stop_job)
    try:  # a signal from whoever read the ready line ends in the lease's release too
        print(json.dumps({"ready": True, "host": args.host, "advertise_host": coord.advertise_host,
                          "port": coord.port, "store_port": coord.store_port,
                          **({"metrics_port": endpoint.port} if endpoint is not None else {}),
                          "heartbeat_s": coord.heartbeat_interval_s,
                          "heartbeat_timeout_s": coord.heartbeat_timeout_s}), flush=True)
        coord.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if lease is not None:
            lease.release()
    return 0
