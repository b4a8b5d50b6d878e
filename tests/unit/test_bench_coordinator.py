"""``recover bench coordinator``'s pure parts: layouts and the CPU reading."""

from __future__ import annotations

import os
import time

import pytest

from recover.bench.coordinator import cpu_seconds, parse_layout
from recover.bench.simclients import layout_conns
from recover.errors import ConfigError


def test_layouts_by_name_and_by_shape() -> None:
    assert parse_layout("16k") == (128, 128) and parse_layout("131k") == (1024, 128)
    assert parse_layout("4x8") == (4, 8)
    for bad in ("1x8", "4x0", "16K", "4*8"):
        with pytest.raises(ConfigError, match="--layout"):
            parse_layout(bad)


def test_connections_per_rank_or_per_replica() -> None:
    per_rank = layout_conns([3, 5], 4, relay=False)
    assert [(c.replica, c.rank) for c in per_rank] == [(r, k) for r in (3, 5) for k in range(4)]
    per_replica = layout_conns([3, 5], 4, relay=True)
    assert [(c.replica, c.ranks, c.relay) for c in per_replica] == [(3, 4, True), (5, 4, True)]


def test_cpu_seconds_of_this_process_grow_with_work() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.monotonic() + 2.0  # the kernel counts in clock ticks (10 ms): spin past one
    while cpu_seconds(os.getpid()) == before and time.monotonic() < deadline:
        sum(i * i for i in range(10_000))
    assert cpu_seconds(os.getpid()) > before >= 0
