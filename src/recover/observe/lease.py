"""One owner per run directory: an exclusive lease, taken before anything is written there.

Contract:
- The lease is the file ``DIR/lease.json``: its holder's host (name and boot id), PID, the PID's start
  time (clock ticks since boot, ``/proc/PID/stat``: a reused PID has another), when it was taken, the
  command and a random ``nonce``. :func:`acquire` creates it with ``O_CREAT | O_EXCL`` (from a file
  written whole beside it: no reader ever sees half a lease) and returns the :class:`Lease`; the holder
  renews it (:meth:`Lease.start_renewing`: its mtime, every :data:`RENEW_S` from a daemon thread) and
  releases it at its exit (:meth:`Lease.release`: deleted only while it is still its own).
- A lease that exists is taken over only when its holder is provably gone: on the same host (same name
  and boot id) its PID runs no more, or runs with another start time (reused); on the same name with
  another boot id the host rebooted; a holder of the same job (``job``, a scheduler's id for it) was
  replaced by that scheduler; on another host it was not renewed for ``ttl_s`` (:data:`TTL_S`),
  its age read on the file system's own clock (the mtime of a probe file just created beside it), so
  no two hosts' clocks are compared (where no probe can be written, this host's clock is used).
  Taking over renames the stale file away first (``rename`` is atomic: of two launches that both
  judged it stale only one moves it; the other finds the new lease and is refused).
- Otherwise :class:`LeaseHeld` (a :class:`~recover.errors.ConfigError`: one line naming the holder) and
  nothing is written. :func:`holder` reads the lease (``recover status`` shows it) without judging it.

What it relies on: an exclusive create and a rename within one directory that are atomic, and mtimes
set by one clock per file system (a local disk, NFSv3/v4, Lustre, GPFS, CephFS: all do). ``flock``
is not used: NFS and some parallel file systems do not honour it across hosts.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recover.errors import ConfigError

NAME = "lease.json"
TTL_S = 30.0
"""A lease of another host not renewed for this long is stale (its holder's host is gone)."""
RENEW_S = 5.0
"""How often the holder renews its lease."""


class LeaseHeld(ConfigError):
    """The run directory belongs to a live job."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory's lease."""

    host: str
    boot_id: str
    pid: int
    pid_start: int | None
    started: float
    command: str
    nonce: str
    job: str = ""
    """The job the holder belongs to (``--lease-job``; empty: none said): a holder of the same job is its
    earlier incarnation, which the job's scheduler replaced."""

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.command} (PID {self.pid} on {self.host}, since {since})"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None when it does not run (or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime (the name may hold spaces)


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def me(command: str, job: str = "") -> Holder:
    """This process as a lease's holder (of ``job``, when one is named)."""
    pid = os.getpid()
    return Holder(socket.gethostname(), _boot_id(), pid, pid_start(pid), time.time(), command, secrets.token_hex(8),
                  job)


def holder(out: Path) -> Holder | None:
    """The holder of ``out``'s lease (None: no lease, or one that cannot be read)."""
    return holder_of_file(Path(out) / NAME)


def _fs_age(path: Path) -> float | None:
    """Seconds since ``path`` was last modified, on its file system's clock (None: it is gone)."""
    probe = path.with_name(f".{NAME}.probe-{secrets.token_hex(4)}")
    try:
        probe.touch()
        now = probe.stat().st_mtime
        probe.unlink()
    except OSError:  # a directory this process cannot write: this host's clock, then
        now = time.time()
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return None


def gone_why(h: Holder, path: Path, ttl_s: float, job: str = "") -> str | None:
    """Why the holder ``h`` of the lease at ``path`` is provably gone, None while it may live (``job``: the
    taker's job; a holder of the same job was replaced by that job's scheduler)."""
    if job and h.job == job:
        return f"it belongs to the same job ({job}), whose scheduler started this replacement"
    if h.host == socket.gethostname() and h.boot_id == _boot_id():
        if not _pid_runs(h.pid):
            return f"PID {h.pid} runs no more"
        start = pid_start(h.pid)
        if h.pid_start is not None and start is not None and start != h.pid_start:
            return f"PID {h.pid} is another process now"
        return None
    if h.host == socket.gethostname() and h.boot_id and _boot_id() and h.boot_id != _boot_id():
        return "its host rebooted"
    age = _fs_age(path)
    if age is not None and age > ttl_s:
        return f"not renewed for {age:.0f} s"
    return None


class Lease:
    """A run directory's lease, held by this process (see the module docstring)."""

    def __init__(self, path: Path, me: Holder, took_over: str | None) -> None:
        self.path = path
        self.me = me
        self.took_over = took_over
        """Why the previous holder's lease was taken over (None: there was none)."""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def ours(self) -> bool:
        """Whether the lease file is still this holder's."""
        h = holder(self.path.parent)
        return h is not None and h.nonce == self.me.nonce

    def renew(self) -> bool:
        """Renews the lease (its mtime); False when it is no longer this holder's. A lease file removed under the
        job (with the whole run directory, which the launcher then creates again) is nobody else's: written
        again as this holder's; never once the lease is being given up."""
        if self._stop.is_set():
            return True
        if holder(self.path.parent) is None:
            try:
                _create(self.path, self.me)
            except OSError:
                return True  # the directory is not there yet: the next renewal writes it
        if not self.ours():
            return False
        try:
            os.utime(self.path)
        except OSError:
            return False
        return True

    def start_renewing(self, every_s: float = RENEW_S) -> None:
        """Renews the lease from a daemon thread until :meth:`release`."""
        def loop() -> None:
            while not self._stop.wait(every_s):
                if not self.renew():
                    print(f"recover: warning: the lease {self.path} is no longer this job's", file=sys.stderr,
                          flush=True)
                    return
        self._renewer = threading.Thread(target=loop, name="lease-renewal", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Gives the run directory up (the lease file is deleted while it is still this holder's), once the
        renewal thread has stopped: a renewal under way would otherwise write the deleted file again."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(10)
        if self.ours():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _create(path: Path, h: Holder) -> bool:
    """Creates the lease file holding ``h``, whole, unless one exists (False)."""
    tmp = path.with_name(f".{NAME}.{h.nonce}")
    tmp.write_text(json.dumps(asdict(h)))
    try:
        os.link(tmp, path)  # exclusive: fails when ``path`` exists (an O_EXCL create of the complete file)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some FUSE file systems): an O_EXCL create, then the content
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(h)))
        return True
    finally:
        tmp.unlink(missing_ok=True)


def refusal(out: Path, h: Holder | None, ttl_s: float = TTL_S) -> str:
    """The one line refusing a launch on ``out`` while ``h`` holds it."""
    who = h.describe() if h else f"a job whose {NAME} cannot be read"
    return (f"--out {out} belongs to a running job: {who}; wait for it to end or stop it (SIGTERM to that PID "
            f"checkpoints it), or choose another --out (a lease whose holder is gone is taken over: on another "
            f"host once not renewed for {ttl_s:g} s)")


def check_free(out: Path, ttl_s: float = TTL_S) -> None:
    """Raises :class:`LeaseHeld` when a live holder has ``out``'s lease (no side effect but a probe file)."""
    path = Path(out) / NAME
    if not path.exists():
        return
    h = holder(out)
    if h is None or gone_why(h, path, ttl_s) is None:
        raise LeaseHeld(refusal(out, h, ttl_s))


def acquire(out: Path, command: str, ttl_s: float = TTL_S, wait_s: float = 0.0, job: str = "") -> Lease:
    """Takes ``out``'s lease (creating ``out``), taking over one whose holder is gone. ``wait_s``: while
    another host's holder may still be alive, how long to wait for its lease to go stale (a job requeued on
    another node right after its old node died) before giving up. ``job``: the job this process belongs
    to (a scheduler's id for it): a lease held by the same job is taken over at once.

    Raises:
        LeaseHeld: one line naming the holder; nothing was written.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _acquire(Path(out), command, ttl_s, job)
        except LeaseHeld:
            h = holder(out)
            if h is None or h.host == socket.gethostname() or time.monotonic() >= deadline:
                raise
            time.sleep(min(1.0, RENEW_S))


def _acquire(out: Path, command: str, ttl_s: float, job: str = "") -> Lease:
    path, mine = out / NAME, me(command, job)
    for _ in range(3):
        out.mkdir(parents=True, exist_ok=True)
        if _create(path, mine):
            return Lease(path, mine, None)
        h = holder(out)
        why = None if h is None else gone_why(h, path, ttl_s, job)
        if why is None:
            raise LeaseHeld(refusal(out, h, ttl_s))
        stale = out / f".{NAME}.stale-{mine.nonce}"
        try:
            os.rename(path, stale)
        except FileNotFoundError:
            continue  # another launch moved it first: try again (it likely holds it now)
        moved = holder_of_file(stale)
        if moved is not None and moved.nonce != h.nonce:  # a fresh lease moved by mistake: put it back
            try:
                os.link(stale, path)
            except FileExistsError:
                pass
            stale.unlink(missing_ok=True)
            raise LeaseHeld(refusal(out, moved, ttl_s))
        stale.unlink(missing_ok=True)
        if _create(path, mine):
            return Lease(path, mine, f"{h.describe()}: {why}")
    raise LeaseHeld(refusal(out, holder(out), ttl_s))


def holder_of_file(path: Path) -> Holder | None:
    """The holder a lease file names (None: it cannot be read)."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
