"""How the coordinator scales with the job: heartbeat cadence, timeout scans, open-files limit.

Pure rules (no sockets, no clock) plus one call that raises this process's open-files limit.

Contract:
* :func:`cadence` adapts the heartbeat interval to the job size so that the coordinator's load
  from heartbeats stays bounded: at most :data:`FRAMES_PER_S` heartbeat frames and
  :data:`RANKS_PER_S` per-rank progress entries a second, whatever the number of GPUs. The
  configured interval is a floor: jobs small enough keep it exactly. Crashes do not wait for
  heartbeats (a closed connection is seen at once); the heartbeat timeout, which only catches
  frozen processes, follows the interval (at least :data:`TIMEOUT_INTERVALS` intervals).
* :func:`scan_interval`: the coordinator checks its timeouts (heartbeats, registration, hangs) on
  this coarser clock rather than at every loop turn, so that its per-tick work is not
  O(connections) every few milliseconds; a timeout is judged at most one scan late.
* :func:`raise_open_files` raises the soft ``RLIMIT_NOFILE`` to the hard limit at coordinator
  start; :func:`check_connections` turns a job that needs more connections than that into one
  clear line.
"""

from __future__ import annotations

import resource

FRAMES_PER_S = 2_000
"""Heartbeat frames a second the coordinator is asked to read, at most (job-wide)."""
RANKS_PER_S = 100_000
"""Per-rank progress entries a second (one per rank in every heartbeat), at most."""
TIMEOUT_INTERVALS = 4.0
"""The heartbeat timeout is at least this many heartbeat intervals."""
RESERVED_FDS = 64
"""Descriptors the coordinator keeps for itself (listener, store, log, wake-up pipe, ...)."""


def cadence(interval_s: float, timeout_s: float, connections: int, ranks: int) -> tuple[float, float]:
    """``(heartbeat interval, heartbeat timeout)`` for a job of ``connections`` coordinator connections
    carrying ``ranks`` ranks in all, from the configured ``interval_s`` and ``timeout_s`` (floors).

    Raises:
        ValueError: non-positive seconds or counts.
    """
    if interval_s <= 0 or timeout_s <= interval_s or connections < 1 or ranks < connections:
        raise ValueError(f"cadence needs 0 < interval ({interval_s}) < timeout ({timeout_s}) and "
                         f"1 <= connections ({connections}) <= ranks ({ranks})")
    interval = max(interval_s, connections / FRAMES_PER_S, ranks / RANKS_PER_S)
    if interval == interval_s:
        return interval_s, timeout_s
    return round(interval, 3), round(max(timeout_s, TIMEOUT_INTERVALS * interval), 3)


def scan_interval(*timeouts_s: float) -> float:
    """Seconds between timeout scans: 1/20 of the shortest positive timeout, within 10 ms..1 s."""
    shortest = min((t for t in timeouts_s if t > 0), default=1.0)
    return min(1.0, max(0.01, shortest / 20))


def job_connections(replicas: int, ranks_per_replica: int, per_replica: bool) -> tuple[int, int]:
    """``(connections, ranks)`` of a job: one connection per replica (a relay) or per rank."""
    ranks = replicas * ranks_per_replica
    return (replicas if per_replica else ranks), ranks


def raise_open_files() -> tuple[int, int]:
    """Raises this process's soft open-files limit to its hard limit; returns ``(soft, hard)`` now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, hard
    return target, hard


def max_connections(soft_limit: int) -> int:
    """Connections the coordinator accepts under an open-files limit of ``soft_limit``."""
    return max(1, soft_limit - RESERVED_FDS)


def check_connections(needed: int, soft_limit: int, hard_limit: int) -> str | None:
    """None when ``needed`` connections fit under the limit; else the one-line reason and the fix."""
    allowed = max_connections(soft_limit)
    if needed <= allowed:
        return None
    return (f"the job needs {needed} coordinator connections but the open-files limit allows {allowed} "
            f"(soft {soft_limit}, hard {hard_limit}, {RESERVED_FDS} kept); raise the hard limit "
            f"(`ulimit -Hn`, /etc/security/limits.conf, LimitNOFILE=) or use one connection per replica")
