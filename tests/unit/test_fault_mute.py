"""The ``mute`` fault kind on its own (its end-to-end run: tests/e2e/test_launch_mute.py)."""

from __future__ import annotations

import pytest

from recover.errors import ConfigError
from recover.faults import FailureSchedule, Perturbation, kind, parse_failure


def test_mute_parses_round_trips_and_counts_as_a_lost_replica() -> None:
    spec = kind("mute").parse("1@4")
    assert (str(spec), spec.kills, parse_failure(str(spec))) == ("1@4:forward=mute", True, spec)
    with pytest.raises(ConfigError, match=r"bad mute '1@4:2': write R@STEP, e.g. 2@12"):
        kind("mute").parse("1@4:2")
    with pytest.raises(ConfigError, match="replica 1 is already killed"):
        FailureSchedule([spec, "1@6"]).validate(3, 10)


def test_mute_stops_the_heartbeats_of_every_rank_from_its_step_and_nothing_else() -> None:
    spec = kind("mute").parse("1@4")
    for rank in range(2):
        p = Perturbation([spec], 1, rank, 2, kill=lambda *a: pytest.fail("killed"), hang=lambda: pytest.fail("hung"))
        assert not p.at_phase(3, "forward") and p.heartbeats()
        assert p.at_phase(4, "forward") and not p.heartbeats()
        assert p.time_factor() == 1.0 and p.gradient(4, 0) is None and not p.unreachable(0)
