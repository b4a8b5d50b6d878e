"""Shared helpers of the side-by-side benchmarks (``recover bench failures`` and ``bench overhead``).

Contract:
- Every system runs as its own child process tree (``python -m recover ...``), started in a new
  session and, if it outlives its time limit or the benchmark is interrupted, stopped by its
  process-group id (never by name): SIGINT first, so that a launcher stops the processes it started
  in sessions of their own (its ``finally``), then SIGKILL after :data:`STOP_GRACE_S`, to the group
  and to every process descended from the child (found under ``/proc``: one that a runner started in
  a session of its own goes too). A run whose work is done (``done``) but whose processes have not
  ended :data:`LINGER_S` later lingers: each of its processes that catches SIGUSR2 (``recover``'s
  entry point dumps every thread's stack on it) is asked for its stacks, into the run's log, then the
  tree is killed and the run's status is :data:`LINGERED` (the benchmark marks it, never counts it).
- A run directory is read only through :mod:`recover.observe.plots` loaders and ``summary.json``;
  the benchmarks never change one except to add files of their own.
- Timing windows are defined here, once, for every system:

  * ``startup_s``: from the ``launch`` event to the start of training (the first ``generation``
    event of the job, i.e. every replica registered, or a runner's ``train_start`` event);
  * ``train_s``: from the start of training to the last committed step's record. It contains
    every recovery, relaunch, redone step, checkpoint save and evaluation of the run, and not
    the one-off start-up that every system pays identically at the beginning.
- Repeated measurements: a benchmark of several rounds runs its systems in :func:`round_orders`
  (forward, then reversed, alternating), so a drift of the machine's load is spread evenly, and
  summarises a quantity over rounds with :func:`spread` (median, min, max, relative spread).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from recover.names import Event
from recover.observe.plots import load_events, load_metrics

SRC_DIR = str(Path(__file__).resolve().parents[2])
START_KINDS = (Event.GENERATION, Event.TRAIN_START)
STOP_GRACE_S = 10.0
"""Seconds a stopped child gets after SIGINT before its process group is SIGKILLed."""
LINGER_S = 60.0
"""Seconds a run's processes get to end once its work is done (see the module docstring)."""
LINGERED = 125
"""The status :func:`run_child` returns for a run whose processes lingered after its work."""
Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with recover's source directory first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def recover_cmd(*args: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "recover", *args]


def run_child(cmd: Sequence[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
              done: Callable[[], bool] | None = None, linger_s: float = LINGER_S) -> int:
    """Runs ``cmd`` with its output in ``log_path``; stops its process tree (:func:`kill_group` with
    :data:`STOP_GRACE_S`) past ``timeout_s`` or when this process is interrupted (SIGINT) or terminated
    (SIGTERM: while the child runs, it raises SystemExit(143) here instead of ending this process
    with the child left running). With ``done`` (the run's work is complete), processes still running
    ``linger_s`` after it first says so have their stacks dumped to the log and are killed.

    Returns:
        the exit status, 124 when the time limit was reached, :data:`LINGERED` when it lingered.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main else None
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=env or child_env(), preexec_fn=_interruptible)
            deadline, finished = time.monotonic() + timeout_s, None
            try:
                while True:
                    try:
                        return proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                    except subprocess.TimeoutExpired:
                        pass
                    now = time.monotonic()
                    if now >= deadline:
                        kill_group(proc, STOP_GRACE_S)
                        return 124
                    if done is not None and finished is None and done():
                        finished = now
                    if finished is not None and now - finished > linger_s:
                        _dump_stacks(proc.pid, log)
                        kill_group(proc)
                        return LINGERED
            except BaseException:
                kill_group(proc, STOP_GRACE_S)
                raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def descendants(pid: int) -> list[int]:
    """Every process descended from ``pid`` (children first), read from ``/proc`` (empty where there is none)."""
    parents: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        parents.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _catches_usr2(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGUSR2 - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _dump_stacks(pid: int, log: Any) -> None:
    """Asks every process of ``pid``'s tree that catches SIGUSR2 for its threads' stacks (into their logs)."""
    tree = [p for p in [pid, *descendants(pid)] if _catches_usr2(p)]
    log.write(f"\n[bench] the run's work is done but processes {tree or [pid]} still run: their stacks follow, "
              f"then they are killed\n".encode())
    log.flush()
    signal_all(tree, signal.SIGUSR2)
    time.sleep(1.0)


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Sends ``sig`` to each of ``pids`` that still exists (by PID, never by name)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _interruptible() -> None:
    """In the child, before it runs: SIGINT back to its default, so that the SIGINT a stop sends first is
    heard even when this benchmark runs where SIGINT is ignored (a background job of a shell, ``nohup``),
    whose children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def kill_group(proc: subprocess.Popen[Any], grace_s: float = 0.0) -> None:
    """SIGKILLs the process group that ``proc`` leads (it was started with a new session) and every process
    descended from it.

    With ``grace_s`` > 0 the group gets SIGINT first and up to ``grace_s`` seconds to exit.
    """
    if grace_s > 0 and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    tree = descendants(proc.pid)  # also those in sessions of their own (a runner's workers)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    signal_all(tree, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def committed(run_dir: Path, steps: int) -> Callable[[], bool]:
    """Whether ``run_dir``'s ``metrics.jsonl`` holds the record of step ``steps - 1`` (a run's work is done;
    steps redone after a rollback come before it)."""
    last = f'"step":{steps - 1},'.encode()

    def done() -> bool:
        try:
            with open(run_dir / "metrics.jsonl", "rb") as f:
                return any(last in line.replace(b" ", b"") for line in f)
        except OSError:
            return False
    return done


def launch_run(out: Path, config: str, replicas: int, steps: int, fails: Iterable[str] = (),
               baseline: str | None = None, overrides: Sequence[str] = (), timeout_s: float = 1800.0) -> int:
    """``recover launch`` of one system into ``out`` (its console output in ``out.log``); the run draws no plots
    of its own (the bench draws its comparisons; ``recover report OUT`` draws a run's)."""
    cmd = recover_cmd("launch", "--config", config, "--replicas", str(replicas), "--steps", str(steps),
                      "--out", str(out), "--no-progress", "--observe.plots=false")
    for spec in fails:
        cmd += ["--fail", str(spec)]
    if baseline:
        cmd += ["--baseline", baseline]
    cmd += list(overrides)
    return run_child(cmd, out.with_name(out.name + ".log"), timeout_s, done=committed(out, steps))


def windows(run_dir: Path) -> dict[str, float]:
    """``launch_t``, ``start_t``, ``end_t`` (unix seconds), ``startup_s`` and ``train_s`` of a run.

    Raises:
        ValueError: the run directory has no ``launch`` event or no committed step.
    """
    events = load_events(run_dir)
    rows = load_metrics(run_dir)
    launch = next((e["t"] for e in events if e.get("kind") == Event.LAUNCH), None)
    if launch is None or not rows:
        raise ValueError(f"{run_dir}: no launch event or no committed step; see {run_dir}.log")
    start = next((e["t"] for e in events if e.get("kind") in START_KINDS), launch)
    end = launch + max(r["elapsed_s"] for r in rows)
    return {"launch_t": launch, "start_t": start, "end_t": end, "startup_s": start - launch,
            "train_s": max(end - start, 1e-9)}


def step_intervals(rows: Sequence[dict[str, Any]], skip: int = 0) -> list[float]:
    """Wall time between consecutive committed steps (by ``elapsed_s``), after the first ``skip`` steps."""
    ordered = sorted(rows, key=lambda r: r["step"])
    return [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(ordered, ordered[1:], strict=False)
            if a["step"] >= skip and b["step"] == a["step"] + 1]


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def round_orders(systems: Sequence[str], rounds: int) -> list[list[str]]:
    """The run order of each round: ``systems`` forward in even rounds, reversed in odd ones."""
    return [list(systems) if r % 2 == 0 else list(reversed(systems)) for r in range(rounds)]


def spread(xs: Sequence[float]) -> dict[str, float | None]:
    """``median``, ``min``, ``max`` of ``xs`` and ``rel_spread`` = (max - min) / median.

    All None for an empty ``xs``; ``rel_spread`` None when the median is 0.
    """
    if not xs:
        return {"median": None, "min": None, "max": None, "rel_spread": None}
    mid = statistics.median(xs)
    return {"median": mid, "min": min(xs), "max": max(xs),
            "rel_spread": (max(xs) - min(xs)) / mid if mid else None}


def machine_load() -> list[float]:
    """The 1, 5 and 15 minute load averages (``uptime``), rounded."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1), encoding="utf-8")


def fmt(value: Any, spec: str = ".3g", none: str = "-") -> str:
    """``value`` formatted with ``spec``; ``None`` as ``none``."""
    if value is None:
        return none
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def print_rich_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
                     notes: Sequence[str] = ()) -> None:
    """A rich table on stdout (plain text when stdout is not a terminal), then one line per note."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    widths = [max([len(col), *(len(row[i]) for row in rows)]) for i, col in enumerate(columns)]
    console = Console(width=max(120, sum(w + 3 for w in widths) + 1))  # every cell on one line
    console.print(table)
    for note in notes:
        console.print(escape(note), highlight=False)  # '[bench]' in a note is text, not rich markup


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Polls ``predicate`` until it holds.

    Raises:
        TimeoutError: naming ``what`` when it does not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(poll_s)


def contended_compute_s(compute_s: float, replicas: int, threads: int, cores: int) -> float:
    """Real compute per microbatch when ``replicas`` processes of ``threads`` threads share ``cores`` cores."""
    return compute_s * max(1.0, replicas * threads / max(cores, 1))


def measure_compute_s(config: str, overrides: Sequence[str], replicas: int,
                      repeats: int = 10) -> tuple[float, float, int]:
    """(fastest, median seconds, threads) of one microbatch's forward and backward of this model, real
    compute only, with the threads a replica process of a ``replicas``-replica job gets; after a warm-up.
    The fastest of ``repeats`` is the compute itself; the median also holds the machine's other load."""
    import torch

    from recover.config import load_config
    from recover.data.prepare import prepared_data_dir
    from recover.train.processes.loop import configure_torch
    from recover.train.processes.trainer import build_replica
    from recover.train.replicas.dist import DistContext

    threads_before = torch.get_num_threads()
    cfg = load_config(config, [*overrides, f"--parallel.replicas={replicas}", "--training.device_time_s=0"])
    replica, _ = build_replica(cfg, DistContext(local_world_size=replicas), prepared_data_dir(cfg.data, quiet=True))
    try:
        configure_torch(cfg, replicas)
        threads = torch.get_num_threads()
        times = []
        for i in range(repeats + 1):
            replica.reset()
            t0 = time.perf_counter()
            replica.compute(i, [0])
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads_before)
    return min(times[1:]), statistics.median(times[1:]), threads
