"""Whether the kernel's OOM killer ended a process: the OOM kills its memory cgroup counted.

Contract: :meth:`MemoryWatch.see` is called for a running process (when it starts, then every
:data:`SEE_EVERY_S`): it records the process's memory cgroup (cgroup v2: the unified hierarchy's
``memory.events``; v1: the memory controller's ``memory.oom_control``), that cgroup's ``oom_kill`` count
and the process's peak resident memory so far (``VmHWM``). After the process died by SIGKILL,
:meth:`MemoryWatch.oom` says whether the count went up since (:class:`OomKill`, with the peak), else
None: no usable memory cgroup (no controller mounted, an older kernel without the count), or no OOM
kill there. A SIGKILL in a cgroup whose count went up at the same time is taken for the OOM killer's
(another process of a shared cgroup killed by it in the same second would be taken for this one too).
Linux only; elsewhere nothing is found and every SIGKILL stays a kill "from outside".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SEE_EVERY_S = 1.0
"""How often the supervisor looks at its running processes' cgroups and peaks."""


@dataclass(frozen=True)
class OomKill:
    """The kernel's OOM killer ended a process."""

    cgroup: str
    """The memory cgroup whose limit was hit (its path under the hierarchy's root)."""
    peak_bytes: int | None
    """The process's peak resident memory as last seen (None: unknown)."""

    def describe(self) -> str:
        peak = f", peak {self.peak_bytes / 2**20:.0f} MiB" if self.peak_bytes else ""
        return f"out of memory (the kernel's OOM killer, memory cgroup {self.cgroup}{peak})"


def _mounts(mountinfo: str | None = None) -> dict[str, Path]:
    """``v2`` and ``v1``: where the unified hierarchy and the v1 memory controller are mounted (from
    ``mountinfo``, default this process's ``/proc/self/mountinfo``)."""
    found: dict[str, Path] = {}
    try:
        text = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
    except OSError:
        return found
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.setdefault("v2", Path(fields[4]))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            found.setdefault("v1", Path(fields[4]))
    return found


def _count(path: Path) -> int | None:
    """The ``oom_kill`` line of a ``memory.events`` or ``memory.oom_control`` file."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _dead(pid: int) -> bool:
    """Whether ``pid`` is gone, a zombie (ended, not reaped yet) or dying: a SIGKILL is pending for it (an
    OOM victim frees its memory before it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    if stat[stat.rindex(")") + 2] in "ZX":
        return True
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) >> (9 - 1) & 1:  # SIGKILL
            return True
    return False


def _peak(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class MemoryWatch:
    """The memory cgroups of running processes, to tell an OOM kill (see the module docstring)."""

    def __init__(self) -> None:
        self._mounts = _mounts()
        self._seen: dict[int, tuple[str, Path, int, int | None]] = {}
        """pid -> (its cgroup, that cgroup's count file, the count then, its peak so far)."""

    def counter(self, pid: int) -> tuple[str, Path] | None:
        """The memory cgroup of ``pid`` and the file counting its OOM kills (None: none usable)."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(",") and "v1" in self._mounts:
                return path, self._mounts["v1"] / path.lstrip("/") / "memory.oom_control"
        for line in lines:
            if line.startswith("0::") and "v2" in self._mounts:
                path = line[3:]
                events = self._mounts["v2"] / path.lstrip("/") / "memory.events"
                if events.is_file():
                    return path, events
        return None

    def see(self, pid: int) -> None:
        """Records ``pid``'s memory cgroup, its OOM kill count and ``pid``'s peak memory, while it runs."""
        if _dead(pid):
            return  # killed since the last look (not reaped yet): what was seen before stands
        found = self.counter(pid)
        count = None if found is None else _count(found[1])
        if found is None or count is None:
            return
        old = self._seen.get(pid)
        self._seen[pid] = (found[0], found[1], count, _peak(pid) or (old[3] if old else None))

    def oom(self, pid: int) -> OomKill | None:
        """After ``pid`` died by SIGKILL: whether its cgroup counted an OOM kill since it was seen."""
        seen = self._seen.pop(pid, None)
        if seen is None:
            return None
        cgroup, path, before, peak = seen
        now = _count(path)
        return OomKill(cgroup, peak) if now is not None and now > before else None

    def forget(self, pid: int) -> None:
        self._seen.pop(pid, None)
