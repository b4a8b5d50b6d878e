"""Which steps the saver checkpoints (recover.train.checkpoints.cadence): a fixed K, or Young/Daly's from
measurements."""

from __future__ import annotations

import math

import pytest

from recover.config import load_config
from recover.errors import ConfigError
from recover.train.checkpoints.cadence import Cadence, default_mtbf_s, young_daly_interval_s, young_daly_steps


def test_young_daly_in_seconds_and_steps() -> None:
    assert young_daly_interval_s(2.0, 10_000.0) == 200.0
    assert young_daly_steps(0.05, 90.0, 0.5) == 6
    assert young_daly_steps(0.0, 90.0, 0.5) == 1  # free checkpoints: every step, never 0
    for bad in ((-1.0, 90.0, 0.5), (0.1, 0.0, 0.5), (0.1, 90.0, math.nan)):
        with pytest.raises(ConfigError):
            young_daly_steps(*bad)


def test_the_default_mtbf_is_the_published_gpu_rate_shared_by_the_job() -> None:
    assert default_mtbf_s(1) == 50_000 * 3600.0
    assert round(default_mtbf_s(16_384) / 3600, 1) == 3.1  # Llama 3 405B: an interruption every ~3 hours
    cfg = load_config("debug", ["--parallel.replicas", "4", "--training.checkpoint_every", "auto"])
    assert Cadence.of(cfg).prior_mtbf_s == default_mtbf_s(4)
    cfg = load_config("debug", ["--training.checkpoint_every", "auto", "--fault_tolerance.mtbf_s", "60"])
    assert Cadence.of(cfg).prior_mtbf_s == 60.0


@pytest.mark.parametrize(("every", "saved"), [(0, []), (3, [2, 5, 8, 9]), (1, list(range(10)))])
def test_a_fixed_interval_saves_every_k_steps_and_the_last(every: int, saved: list[int]) -> None:
    cadence = Cadence(every, prior_mtbf_s=1.0)
    assert [s for s in range(10) if cadence.due(s, 10)] == saved
    assert cadence.choose() == every  # measurements change nothing


def test_auto_saves_first_to_measure_then_every_young_daly_steps_and_the_last() -> None:
    cadence = Cadence("auto", prior_mtbf_s=800.0)
    cadence.stepped(1.0, failures=0)
    assert cadence.due(0, 100)  # the first save measures the cost
    cadence.saved(1, blocking_s=0.5)
    assert cadence.set(cadence.choose()) and cadence.every == round(math.sqrt(2 * 0.5 * 801.0))  # 28 steps
    due = [s for s in range(1, 100) if cadence.due(s, 100)]
    assert due[0] == 28 and due[-1] == 99  # 1 + 28 committed steps, and the end
    assert not cadence.set(cadence.choose())  # unchanged: nothing to log


def test_auto_failures_shorten_the_interval_and_the_prior_fades() -> None:
    cadence = Cadence("auto", prior_mtbf_s=10_000.0)
    for _ in range(10):
        cadence.stepped(1.0, failures=0)
    cadence.saved(10, blocking_s=2.0)
    quiet = cadence.choose()
    assert quiet == round(math.sqrt(2 * 2.0 * 10_010.0))
    cadence.stepped(1.0, failures=3)  # three replicas lost in one step
    assert cadence.mtbf_s() == pytest.approx(10_011.0 / 4)
    assert cadence.choose() == round(math.sqrt(2 * 2.0 * 10_011.0 / 4)) < quiet
    cadence.saved(11, blocking_s=2.0)
    assert cadence.describe() == {"every": cadence.every, "save_cost_s": 2.0, "mtbf_s": 2502.75,
                                  "step_time_s": 1.0, "failures": 3}


def test_the_cost_and_step_time_are_medians_so_one_slow_save_or_step_does_not_set_the_interval() -> None:
    cadence = Cadence("auto", prior_mtbf_s=5000.0)
    for t in (1.0, 1.0, 30.0):  # a step with a recovery in it
        cadence.stepped(t, failures=0)
    for committed, cost in ((1, 9.0), (2, 0.4), (3, 0.4)):  # the first save also describes the run
        cadence.saved(committed, cost)
    assert cadence.choose() == round(math.sqrt(2 * 0.4 * cadence.mtbf_s()) / 1.0)


def test_a_replica_that_has_not_saved_saves_at_once_when_it_becomes_the_saver() -> None:
    survivor = Cadence("auto", prior_mtbf_s=1000.0)  # measured step times and failures, never saved
    for _ in range(5):
        survivor.stepped(0.5, failures=0)
    survivor.stepped(0.5, failures=1)  # the saver was lost in this step
    assert survivor.due(5, 50) and survivor.choose() == 0  # saves now, to measure C, before choosing K
    survivor.saved(6, blocking_s=0.1)
    assert survivor.choose() == round(math.sqrt(2 * 0.1 * (1003.0 / 2)) / 0.5)
