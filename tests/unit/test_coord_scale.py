"""The coordinator's scale rules: heartbeat cadence by job size, scan clock, open-files limit."""

from __future__ import annotations

import resource

import pytest

from recover.coord import scale


def test_small_jobs_keep_the_configured_heartbeat_exactly() -> None:
    assert scale.cadence(0.1, 1.0, 64, 64) == (0.1, 1.0)
    assert scale.cadence(0.1, 1.0, *scale.job_connections(16, 8, per_replica=False)) == (0.1, 1.0)


def test_large_jobs_get_a_longer_interval_that_bounds_the_coordinators_load() -> None:
    for replicas, ranks_per in ((128, 128), (1024, 128)):
        for per_replica in (False, True):
            conns, ranks = scale.job_connections(replicas, ranks_per, per_replica)
            interval, timeout = scale.cadence(0.1, 1.0, conns, ranks)
            assert conns / interval <= scale.FRAMES_PER_S * 1.001
            assert ranks / interval <= scale.RANKS_PER_S * 1.001
            assert timeout >= scale.TIMEOUT_INTERVALS * interval * 0.999 and timeout > interval
    # 131k GPUs through one connection per replica: 1024 frames of 128 ranks every ~1.3 s
    assert scale.cadence(0.1, 1.0, 1024, 131072) == (1.311, 5.243)


def test_cadence_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="cadence"):
        scale.cadence(0.1, 0.1, 4, 4)
    with pytest.raises(ValueError, match="cadence"):
        scale.cadence(0.1, 1.0, 4, 2)


def test_scan_interval_is_a_twentieth_of_the_shortest_timeout_within_bounds() -> None:
    assert scale.scan_interval(1.0, 10.0, 0.0) == pytest.approx(0.05)
    assert scale.scan_interval(0.1) == 0.01
    assert scale.scan_interval(600.0) == 1.0


def test_connection_check_names_the_need_the_limit_and_the_fix() -> None:
    assert scale.check_connections(1000, 20000, 20000) is None
    msg = scale.check_connections(131072, 20000, 20000)
    assert msg is not None and "131072" in msg and str(20000 - scale.RESERVED_FDS) in msg
    assert "one connection per replica" in msg and "\n" not in msg


def test_raise_open_files_lifts_the_soft_limit_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
        new_soft, new_hard = scale.raise_open_files()
        assert new_hard == hard and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == new_soft
        assert new_soft == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_coordinator_adapts_its_cadence_and_refuses_a_job_beyond_the_open_files_limit(monkeypatch) -> None:
    from recover.coord.server import Coordinator
    from recover.errors import ConfigError

    small = Coordinator(token="t", expected_replicas=4)
    assert (small.heartbeat_interval_s, small.heartbeat_timeout_s) == (0.1, 1.0)
    big = Coordinator(token="t", expected_replicas=1024, ranks_per_replica=128, per_replica_connections=True)
    assert (big.connections, big.heartbeat_interval_s, big.heartbeat_timeout_s) == (1024, 1.311, 5.243)
    monkeypatch.setattr(scale, "raise_open_files", lambda: (20000, 20000))
    per_rank = Coordinator(token="t", expected_replicas=1024, ranks_per_replica=128)
    with pytest.raises(ConfigError, match="needs 131072 coordinator connections"):
        per_rank.start()
