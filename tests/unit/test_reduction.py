"""The streamed reduction (:mod:`recover.comm.reduction`) and a replica's last backward feeding it.

The group side is a recording stand-in (a one-member "all-reduce" that returns its copy): what is under
test here is the bookkeeping (which bucket is launched when, never out of plan order, a kept failure)
and that a one-process replica really launches buckets while its last backward is still running, with
the same sums as a replica that folds after the backward. The real group under failures is covered by
the multi-process and end-to-end tiers (every kill there goes through this path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_parallel import CFG, _Sampler

from recover.comm.reduction import Reduction, plan_buckets
from recover.config import TrainingConfig
from recover.faults import Perturbation, kind
from recover.train.replicas.replica import Replica


class Recording(Reduction):
    """Launches nothing; records each launch with which tensors were final at that moment."""

    def __init__(self, *args: Any, fail_at: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.launches: list[tuple[list[int], list[bool]]] = []
        self.fail_at = fail_at

    def _start(self, flat: torch.Tensor) -> Any:
        if len(self.launches) == self.fail_at:
            raise RuntimeError("peer gone")
        self.launches.append((self.buckets[len(self.launches)], list(self._final)))
        return None

    def _finish(self, works: list[Any], flats: list[torch.Tensor]) -> None:
        return None


def test_buckets_follow_the_order_and_the_first_one_is_small() -> None:
    ts = [torch.zeros(n) for n in (10, 10, 10, 10)]  # 40 bytes each
    assert plan_buckets(ts, 80, order=[3, 2, 1, 0]) == [[3, 2], [1, 0]]
    assert plan_buckets(ts, 80, order=[3, 2, 1, 0], first_bucket_bytes=40) == [[3], [2, 1], [0]]
    assert plan_buckets(ts, 80) == [[0, 1], [2, 3]]


def test_buckets_launch_in_plan_order_whatever_order_tensors_become_final() -> None:
    ts = [torch.full((10,), float(i)) for i in range(4)]
    r = Recording(ts, order=[3, 2, 1, 0], bucket_bytes=40)
    r.final(1)
    r.final(0)
    assert r.launched == 0  # bucket [3] comes first in the plan: nothing may overtake it
    r.final(3)
    assert [idx for idx, _ in r.launches] == [[3]]
    r.final(3)  # idempotent
    r.final(2)
    assert [idx for idx, _ in r.launches] == [[3], [2], [1], [0]]
    out = r.result()
    assert all(torch.equal(a, b) for a, b in zip(out, ts, strict=True))  # a copy of each, in place


def test_a_failed_launch_is_kept_for_result_and_nothing_after_it_is_launched() -> None:
    ts = [torch.zeros(10) for _ in range(3)]
    r = Recording(ts, bucket_bytes=40, fail_at=1)
    for i in range(3):
        r.final(i)  # never raises: it runs inside autograd hooks
    assert r.launched == 1
    with pytest.raises(RuntimeError, match="peer gone"):
        r.result()


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_last_backward_launches_buckets_before_it_ends_and_sums_equal_the_plain_fold(deterministic: bool) -> None:
    tc = TrainingConfig(seed=3, deterministic=deterministic)
    streamed, plain = Replica(CFG, tc, _Sampler()), Replica(CFG, tc, _Sampler())
    payload = streamed.payload()
    small = 4 * max(p.numel() for p in streamed.params)  # several buckets
    r = Recording(payload, order=streamed.reduce_order, bucket_bytes=small, first_bucket_bytes=small)
    streamed.compute(5, [1, 4, 2], final=r.final)
    plain.compute(5, [1, 4, 2])
    # buckets went out while the backward still had the embedding (parameter 0) to finish
    early = [idx for idx, final in r.launches if not final[0]]
    assert early and len(early) < len(r.buckets)
    assert not r._final[len(payload) - 1]  # the stats are the protocol's to finalise (after its checks)
    reduced = r.result()
    for a, b in zip(reduced, plain.payload(), strict=True):
        assert torch.equal(a, b)
    assert streamed.ledger == plain.ledger and streamed.nonfinite == []
    assert all(p.grad is None for p in streamed.params)


def nan_at(replica: Replica, step: int, mb: int) -> None:
    """``--nan 0@STEP:MB`` on ``replica``, struck at once."""
    replica.perturb = Perturbation([kind("nan").parse(f"0@{step}:{mb}")], 0)
    assert replica.perturb.at_phase(step, "forward")


def test_a_nan_in_the_streamed_pass_is_found_and_named() -> None:
    replica = Replica(CFG, TrainingConfig(seed=3), _Sampler())
    nan_at(replica, 0, 2)  # the last pass of the call: folded from hooks, found in the buffers
    r = Recording(replica.payload(), order=replica.reduce_order)
    replica.compute(0, [0, 1, 2], final=r.final)
    assert replica.nonfinite == [2]
    other = Replica(CFG, TrainingConfig(seed=3), _Sampler())
    nan_at(other, 0, 0)  # a pass before the last
    other.compute(0, [0, 1, 2])
    assert other.nonfinite == [0]
