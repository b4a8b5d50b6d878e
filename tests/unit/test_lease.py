"""The run directory's lease (:mod:`recover.observe.lease`): who may take it, and when it is taken over."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from recover.observe import lease
from recover.observe.lease import LeaseHeld, acquire, check_free, holder


def _plant(run: Path, h: lease.Holder, age_s: float = 0.0) -> None:
    run.mkdir(parents=True, exist_ok=True)
    path = run / lease.NAME
    path.write_text(json.dumps(asdict(h)))
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))


def test_a_lease_is_exclusive_renewed_and_released(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with acquire(run, "recover launch") as held:
        assert held.took_over is None and holder(run) == held.me and held.me.pid == os.getpid()
        with pytest.raises(LeaseHeld, match=rf"belongs to a running job: recover launch \(PID {os.getpid()} on "):
            acquire(run, "recover launch")  # this very process still runs: never taken over
        with pytest.raises(LeaseHeld):
            check_free(run)
        assert held.renew()
    assert not (run / lease.NAME).exists() and sorted(p.name for p in run.iterdir()) == []
    check_free(run)


def test_a_renewal_under_way_when_the_lease_is_released_does_not_write_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewal thread is inside a renewal when the holder releases the lease: the release waits for it, and
    the renewal, seeing the lease given up, writes nothing (before, it found the file gone and wrote it again,
    leaving a dead process's lease behind; seen on a loaded machine)."""
    import threading

    run = tmp_path / "run"
    held = acquire(run, "recover coordinator")
    entered, go, done = threading.Event(), threading.Event(), threading.Event()
    original = lease.Lease.renew

    def held_up(self: lease.Lease) -> bool:
        entered.set()
        go.wait(10)
        try:
            return original(self)
        finally:
            done.set()

    monkeypatch.setattr(lease.Lease, "renew", held_up)
    held.start_renewing(every_s=0.01)
    assert entered.wait(10)
    threading.Timer(0.2, go.set).start()  # the renewal goes on while the release is under way
    held.release()
    assert done.wait(10)
    assert not (run / lease.NAME).exists()


def test_a_lease_of_a_reused_pid_or_a_rebooted_host_is_taken_over(tmp_path: Path) -> None:
    mine = lease.me("recover launch")
    _plant(tmp_path, replace(mine, pid_start=(mine.pid_start or 0) + 1, nonce="old"))  # same PID, another process
    taken = acquire(tmp_path, "recover launch")
    assert taken.took_over is not None and "is another process now" in taken.took_over
    taken.release()
    _plant(tmp_path, replace(mine, boot_id="another-boot", nonce="old"))
    taken = acquire(tmp_path, "recover launch")
    assert taken.took_over is not None and "rebooted" in taken.took_over
    taken.release()


def test_another_hosts_lease_is_taken_over_only_once_it_was_not_renewed_for_its_ttl(tmp_path: Path) -> None:
    other = replace(lease.me("recover launch"), host="node-b", boot_id="b", pid=1, nonce="b")
    _plant(tmp_path, other, age_s=5)
    with pytest.raises(LeaseHeld, match="PID 1 on node-b"):
        acquire(tmp_path, "recover launch", ttl_s=30)
    assert holder(tmp_path) == other  # nothing written
    _plant(tmp_path, other, age_s=60)
    taken = acquire(tmp_path, "recover launch", ttl_s=30)
    assert taken.took_over is not None and "not renewed for 60 s" in taken.took_over
    assert holder(tmp_path) == taken.me
    taken.release()


def test_a_holder_that_lost_its_lease_does_not_delete_the_new_one(tmp_path: Path) -> None:
    first = acquire(tmp_path, "recover launch")
    _plant(tmp_path, replace(first.me, nonce="someone-else"))
    assert not first.renew()
    first.release()
    assert holder(tmp_path) is not None and holder(tmp_path).nonce == "someone-else"


def test_a_requeued_job_waits_for_another_hosts_lease_to_go_stale(tmp_path: Path) -> None:
    other = replace(lease.me("recover coordinator"), host="node-b", boot_id="b", pid=1, nonce="b")
    _plant(tmp_path, other, age_s=0.5)
    t0 = time.monotonic()
    taken = acquire(tmp_path, "recover coordinator", ttl_s=1.5, wait_s=5.0)
    assert 0.5 < time.monotonic() - t0 < 4.5 and taken.took_over is not None
    taken.release()


def test_a_lease_of_the_same_job_is_taken_over_at_once_and_another_jobs_is_not(tmp_path: Path) -> None:
    """A coordinator its scheduler replaced on another host (a Kubernetes pod, a requeued Slurm job) names the
    same job: it takes the fresh lease of its predecessor at once; a second job on the directory does not."""
    run = tmp_path / "run"
    _plant(run, replace(lease.me("recover coordinator", job="trainer"), host="pod-a", boot_id="other"))
    with pytest.raises(LeaseHeld):
        acquire(run, "recover coordinator", job="another-job")
    with acquire(run, "recover coordinator", job="trainer") as held:
        assert held.took_over is not None and "same job (trainer)" in held.took_over
        assert holder(run) == held.me and held.me.job == "trainer"
    old = {k: v for k, v in asdict(lease.me("recover launch")).items() if k != "job"}  # a lease of an older release
    (run / lease.NAME).write_text(json.dumps(old))
    assert holder(run) is not None and holder(run).job == ""
