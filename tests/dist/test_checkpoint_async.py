"""Asynchronous DCP checkpoints (``training.checkpoint_async``): visible only once complete.

- an async save returns once the state is staged; the checkpoint is invisible (only a
  ``.partial`` directory) until its background write finished and the commit ran, and it holds
  the state of the moment it was started even if training changes the model meanwhile;
- a failed background write commits nothing and is reported by ``wait``;
- a process SIGKILLed while async saves are being written leaves no loadable torn checkpoint;
- a training run with async saves resumes from one and reproduces the trajectory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import losses, max_rel_diff, subprocess_env
from recover.cli import main
from recover.config import ModelConfig
from recover.errors import CheckpointError
from recover.train.checkpoints import checkpoint as ckpt
from recover.train.checkpoints import writer as writer_mod

CFG = ModelConfig()  # only stored in meta.json here: the modules below are plain nn.Linear


def small(value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose parameters are all ``value``, with an AdamW state (one step taken)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    fill(model, value)
    return model, opt


def fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def params_equal(model: nn.Module, value: float) -> bool:
    return all(torch.all(p == value) for p in model.parameters())


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every ``dcp.async_save``'s completion until the event is set (the files are written)."""
    import torch.distributed.checkpoint as dcp

    real = dcp.async_save
    release = threading.Event()

    def gated(*args, **kwargs) -> Future:
        inner, outer = real(*args, **kwargs), Future()

        def relay() -> None:
            release.wait(60)
            try:
                outer.set_result(inner.result())
            except Exception as exc:  # relayed to the waiter
                outer.set_exception(exc)

        threading.Thread(target=relay, daemon=True).start()
        return outer

    monkeypatch.setattr(dcp, "async_save", gated)
    return release


def test_async_save_is_loadable_only_once_complete_and_holds_the_staged_state(tmp_path: Path,
                                                                             gate: threading.Event) -> None:
    model, opt = small(1.0)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {"tag": "old"}, CFG)
    fill(model, 2.0)
    pending = ckpt.save_checkpoint_async(tmp_path, 2, model, opt, {"tag": "new"}, CFG)
    fill(model, 3.0)  # training goes on while the write is in flight
    time.sleep(0.2)
    assert not pending.done()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert (tmp_path / "step_000002.partial").is_dir() and not (tmp_path / "step_000002").exists()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.read_meta(tmp_path / "step_000002.partial")
    gate.set()
    assert pending.wait(60) == tmp_path / "step_000002"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert not (tmp_path / "step_000002.partial").exists()
    fresh, fresh_opt = small(0.0)
    meta = ckpt.load_checkpoint(tmp_path / "step_000002", fresh, fresh_opt, CFG)
    assert meta["step"] == 2 and meta["tag"] == "new"
    assert params_equal(fresh, 2.0)  # the state when the save started, not the 3.0 of afterwards
    ref = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], ref)


def test_a_failed_async_write_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    def broken(*args, **kwargs) -> Future:
        fut: Future = Future()
        fut.set_exception(OSError("disk full"))
        return fut

    monkeypatch.setattr(dcp, "async_save", broken)
    model, opt = small(1.0)
    pending = ckpt.save_checkpoint_async(tmp_path, 5, model, opt, {}, CFG)
    with pytest.raises(CheckpointError, match="step 5 failed.*disk full"):
        pending.wait(10)
    assert ckpt.list_checkpoints(tmp_path) == []


def test_replacing_a_checkpoint_of_the_same_step_never_exposes_a_torn_one(tmp_path: Path) -> None:
    model, opt = small(1.0)
    ckpt.save_checkpoint(tmp_path, 3, model, opt, {}, CFG)
    fill(model, 4.0)
    ckpt.save_checkpoint_async(tmp_path, 3, model, opt, {}, CFG).wait(60)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]
    fresh, fresh_opt = small(0.0)
    ckpt.load_checkpoint(tmp_path / "step_000003", fresh, fresh_opt, CFG)
    assert params_equal(fresh, 4.0)


SAVER = """
import sys, torch
from torch import nn
from recover.config import ModelConfig
from recover.train.checkpoints import checkpoint as ckpt
from recover.train.checkpoints import writer as writer_mod
root = sys.argv[1]
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # ~1 M floats: ~12 MB with AdamW state
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 512)).sum().backward()
opt.step()
pending = None
for step in range(1, 1000):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    if pending is not None:
        pending.wait()
    pending = ckpt.save_checkpoint_async(root, step, model, opt, {"value": step}, ModelConfig())
    print(step, flush=True)
"""


def test_a_process_killed_during_async_saves_leaves_no_loadable_torn_checkpoint(tmp_path: Path) -> None:
    """SIGKILL 30 ms after an async save started: its write is in flight (here a save takes ~100 ms and
    the kill finds a half-written ``.distcp`` file in ``step_000004.partial``); whatever the timing,
    every visible checkpoint is complete and holds the state of its own step."""
    root = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root)], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env(), start_new_session=True)
    try:
        for line in proc.stdout:
            if int(line) == 4:  # steps 1..3 are committed (3 was awaited), 4's write has just started
                time.sleep(0.03)
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    found = ckpt.list_checkpoints(root)
    last = len(found)  # 3 or 4; more when the saver ran ahead of this (loaded) reader
    assert last >= 3 and [s for s, _ in found] == list(range(1, last + 1))
    for step, path in found:
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
        opt = torch.optim.AdamW(model.parameters())
        assert ckpt.load_checkpoint(path, model, opt, ModelConfig())["value"] == step
        assert params_equal(model, float(step))
    leftovers = {p.name for p in root.iterdir()} - {p.name for _, p in found}
    assert leftovers <= {f"step_{last + 1:06d}.partial"}  # only the save the kill cut short


def train_args(out: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", "--config", "debug", "--out", str(out), "--no-progress", "--data.path", str(corpus),
            "--training.steps=12", "--training.eval_every=6", "--training.threads=1",
            "--training.checkpoint_every=3", *extra]


def test_resume_from_an_async_checkpoint_reproduces_the_trajectory(corpus: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ref, run = tmp_path / "sync", tmp_path / "async"
    assert main(train_args(ref, corpus, "--training.checkpoint_every=auto")) == 0
    # Young/Daly: the first save measures the cost; on a job this small the next is due long after the last step
    assert [s for s, _ in ckpt.list_checkpoints(ref / "checkpoints")] == [1, 12]
    assert main([*train_args(run, corpus, "--training.checkpoint_async=true"), "--stop-at-step", "8"]) == 0
    # saves after steps 3 and 6 were async, the one at the stop (8) too: the run waited for it at its end
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [3, 6, 8]
    assert not list((run / "checkpoints").glob("*.partial"))
    capsys.readouterr()
    assert main([*train_args(run, corpus, "--training.checkpoint_async=true"), "--resume"]) == 0
    assert "(step 8)" in capsys.readouterr().out
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [8, 9, 12]  # keep_checkpoints = 3
    assert max_rel_diff(losses(ref), losses(run)) <= 1e-6


# ---- the writer process (train/checkpoints/writer.py) ------------------------------------------------

def ready_writer(model: nn.Module, opt: torch.optim.Optimizer) -> writer_mod.Writer:
    """A writer whose process is up for this model's state (the first ``takes`` starts it)."""
    writer = writer_mod.Writer()
    state = ckpt._state(model, opt)
    deadline = time.monotonic() + 120
    while not writer.takes(state):
        assert time.monotonic() < deadline, "the writer process did not become ready within 120 s"
        time.sleep(0.1)
    return writer


def writer_pid(writer: writer_mod.Writer) -> int:
    assert writer._child is not None
    return writer._child.proc.pid


def test_a_save_by_the_writer_process_holds_the_staged_state_and_loads_like_one_from_training(tmp_path: Path) -> None:
    model, opt = small(1.0)
    ckpt.save_checkpoint(tmp_path / "here", 2, model, opt, {"tag": "here"}, CFG)
    writer = ready_writer(model, opt)
    try:
        pending = ckpt.save_checkpoint_async(tmp_path / "there", 2, model, opt, {"tag": "there"}, CFG, writer=writer)
        fill(model, 3.0)  # training goes on at once: the state was copied out
        assert pending.wait(60) == tmp_path / "there" / "step_000002"
        assert not list((tmp_path / "there").glob("*.partial"))
        loaded = []
        for where in ("here", "there"):
            fresh, fresh_opt = small(0.0)
            meta = ckpt.load_checkpoint(tmp_path / where / "step_000002", fresh, fresh_opt, CFG)
            assert meta["tag"] == where and meta["step"] == 2
            loaded.append((fresh.state_dict(), fresh_opt.state_dict()))
        assert params_equal(fresh, 1.0)  # the state when the save started, not the 3.0 of afterwards
        (m1, o1), (m2, o2) = loaded
        assert all(torch.equal(m1[k], m2[k]) for k in m1)
        assert all(torch.equal(o1["state"][i][k], o2["state"][i][k]) for i in o1["state"] for k in o1["state"][i])
        assert o1["param_groups"] == o2["param_groups"]
        # the buffer is reused: a second save of a changed state holds the new values
        fill(model, 5.0)
        ckpt.save_checkpoint_async(tmp_path / "there", 3, model, opt, {}, CFG, writer=writer).wait(60)
        fresh, fresh_opt = small(0.0)
        ckpt.load_checkpoint(tmp_path / "there" / "step_000003", fresh, fresh_opt, CFG)
        assert params_equal(fresh, 5.0)
        # a state that outgrew the buffer goes into a larger one, handed to the same process
        big = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
        big_opt = torch.optim.AdamW(big.parameters(), lr=0.1)
        big(torch.ones(2, 64)).sum().backward()
        big_opt.step()
        fill(big, 7.0)
        pid = writer_pid(writer)
        assert writer.takes(ckpt._state(big, big_opt))
        ckpt.save_checkpoint_async(tmp_path / "there", 4, big, big_opt, {}, CFG, writer=writer).wait(60)
        assert writer_pid(writer) == pid
        fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        ckpt.load_checkpoint(tmp_path / "there" / "step_000004", fresh, fresh_opt, CFG)
        assert params_equal(fresh, 7.0)
    finally:
        writer.close()


def test_a_write_the_storage_refuses_fails_with_its_errno_and_commits_nothing(tmp_path: Path) -> None:
    model, opt = small(1.0)
    writer = ready_writer(model, opt)
    try:
        ckpt.save_checkpoint_async(tmp_path, 4, model, opt, {}, CFG, writer=writer).wait(60)
        final, partial = ckpt.begin_save(tmp_path, 5)
        partial.rmdir()
        partial.write_text("a file where the save's directory was")  # the writer cannot write into it
        with pytest.raises(OSError) as err:
            writer.submit(ckpt._state(model, opt), partial, final, 5, {}, 0, None).result(60)
        assert err.value.errno is not None
        assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4]
        # the process goes on: the next save is written
        ckpt.save_checkpoint_async(tmp_path, 6, model, opt, {}, CFG, writer=writer).wait(60)
        assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    finally:
        writer.close()


def test_a_killed_writer_process_fails_its_save_and_the_next_state_starts_another(tmp_path: Path) -> None:
    model, opt = small(1.0)
    writer = ready_writer(model, opt)
    try:
        first = writer_pid(writer)
        os.kill(first, signal.SIGKILL)
        final, partial = ckpt.begin_save(tmp_path, 7)
        with pytest.raises(CheckpointError, match=r"writer process ended \(killed by signal 9\) before the save"):
            writer.submit(ckpt._state(model, opt), partial, final, 7, {}, 0, None).result(60)
        assert ckpt.list_checkpoints(tmp_path) == []
        # the next state is saved by the caller while another process starts, then by that process
        assert not writer.takes(ckpt._state(model, opt))
        assert writer_pid(writer) != first
    finally:
        writer.close()
    writer = ready_writer(model, opt)
    writer.close()


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie nobody reaped yet) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if "Z" in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]:
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


WRITER_PARENT = """
import sys, time, torch
from torch import nn
from recover.config import ModelConfig
from recover.train.checkpoints import checkpoint as ckpt, writer as writer_mod
model = nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
w = writer_mod.Writer()
while not w.takes(ckpt._state(model, opt)):
    time.sleep(0.05)
print(w._child.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_writer_process_ends_with_the_process_it_writes_for(tmp_path: Path) -> None:
    """A replica SIGKILLed alone (not its process group): its writer must not outlive it and commit later."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER_PARENT], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert gone_within(child, 10), f"the writer process {child} outlived its parent by 10 s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


FORKING_PARENT = """
import json, os, sys, threading, time
from pathlib import Path
import torch
from torch import nn
from recover.config import ModelConfig
from recover.train.checkpoints import checkpoint as ckpt, writer as writer_mod
stop = threading.Event()
other = threading.Thread(target=stop.wait, name="some-thread")
other.start()
refused = writer_mod.prefork()  # a thread runs: no fork
stop.set()
other.join()
forked = writer_mod.prefork()
spare = writer_mod._spare.proc.pid
model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # as small() makes
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.ones(2, 16)).sum().backward()
opt.step()
w = writer_mod.Writer()
t0 = time.monotonic()
while not w.takes(ckpt._state(model, opt)):
    time.sleep(0.001)
ready_s = time.monotonic() - t0
pid = w._child.proc.pid
path = ckpt.save_checkpoint_async(Path(sys.argv[1]), 3, model, opt, {}, ModelConfig(), writer=w).wait(60)
fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
print(json.dumps({"refused": refused, "forked": forked, "spare": spare, "pid": pid, "ready_s": ready_s,
                  "path": str(path), "ppid": int(fields[1]), "cmdline": Path(f"/proc/{pid}/cmdline").read_bytes()
                  .decode().split("\\0"), "fds": {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}")
                                                                 for fd in os.listdir(f"/proc/{pid}/fd")},
                  "value": model[0].weight[0, 0].item()}), flush=True)
time.sleep(600)
"""


def test_a_writer_forked_at_the_start_is_taken_ready_writes_and_dies_with_its_parent(tmp_path: Path) -> None:
    """The replica's writer forked before any thread ran (no new interpreter at the first save): refused while
    a thread runs; taken ready by the first Writer; its own command line and only its socket and standard
    streams open; its checkpoint loads; SIGKILL of its parent alone ends it at once."""
    import json

    proc = subprocess.Popen([sys.executable, "-c", FORKING_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env(), start_new_session=True)
    try:
        assert proc.stdout is not None
        got = json.loads(proc.stdout.readline())
        assert got["refused"] is False and got["forked"] is True
        assert got["pid"] == got["spare"] and got["ppid"] == proc.pid
        assert got["ready_s"] < 5, "a forked writer is ready without importing anything"
        assert got["cmdline"][1:3] == ["-m", "recover.train.checkpoints.writer"], got["cmdline"]
        # stdin, stdout, stderr, its socket and the buffer it maps: nothing else of its parent's
        mine = [f for fd, f in got["fds"].items() if int(fd) > 2]
        assert [f for f in mine if not f.startswith(("socket:", "/memfd:recover-checkpoint"))] == [], got["fds"]
        assert len(mine) <= 2, got["fds"]
        fresh, fresh_opt = small(0.0)
        ckpt.load_checkpoint(Path(got["path"]), fresh, fresh_opt, CFG)
        assert fresh[0].weight[0, 0].item() == got["value"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert gone_within(got["pid"], 2), "the forked writer outlived its parent by 2 s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
