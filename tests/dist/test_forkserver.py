"""The fork server: a forked ``recover`` command is the caller's own child, set up exactly as asked, outlives
the server, and a server that cannot serve leaves the caller starting new interpreters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SRC
from recover import forking
from recover.launch import forkserver
from recover.launch.processes import spawn

pytestmark = pytest.mark.skipif(not forkserver.supported(), reason="fork server: Linux only")


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **extra}


def _coordinator(tmp_path: Path) -> list[str]:
    (tmp_path / "token").write_text("t0ken\n")
    return [sys.executable, "-m", "recover", "coordinator", "--port", "0", "--store-port", "0", "--token-file",
            str(tmp_path / "token"), "--events", str(tmp_path / "events.jsonl"), "--replicas", "2"]


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    srv = forkserver.start(tmp_path / "forkserver.log")
    assert srv is not None
    yield srv
    srv.close()


def _wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_forked_command_is_our_child_set_up_as_asked_and_outlives_the_server(server, tmp_path: Path) -> None:
    cmd = _coordinator(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    extra = open(tmp_path / "extra", "wb")  # noqa: SIM115
    with open(tmp_path / "out.log", "wb") as log:
        proc = server.popen(cmd, _env(), stdout=log, stderr=subprocess.STDOUT,
                            pass_fds=(extra.fileno(),), cwd=str(work))
    try:
        _check_forked(server, proc, cmd, tmp_path, work, extra)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _check_forked(server, proc, cmd: list[str], tmp_path: Path, work: Path, extra) -> None:
    assert isinstance(proc, forking.Forked) and server.forked == 1
    _wait_for(lambda: b'"port"' in (tmp_path / "out.log").read_bytes())  # its ready record, on the stdout given
    pid = proc.pid
    stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    assert int(stat[1]) == os.getpid()  # its parent is the caller, not the server
    assert os.getsid(pid) == pid  # a session of its own
    assert Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0") == [a.encode() for a in cmd]
    assert os.readlink(f"/proc/{pid}/cwd") == str(work)
    assert os.readlink(f"/proc/{pid}/fd/{extra.fileno()}") == str(tmp_path / "extra")
    extra.close()
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    server.proc.kill()  # the server's death ends none of its workers
    server.proc.wait(10)
    time.sleep(0.3)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL and proc.returncode == -signal.SIGKILL


def test_exit_statuses_a_pipe_on_stdin_and_a_dead_server_falls_back_to_a_new_interpreter(server, tmp_path) -> None:
    log = tmp_path / "a.log"
    with open(tmp_path / "help", "wb") as out:  # the environment asked, not the server's: argparse's width
        wide = server.popen([sys.executable, "-m", "recover", "--help"], _env(COLUMNS="300"), stdout=out)
    assert wide.wait(timeout=30) == 0
    assert max(map(len, (tmp_path / "help").read_text().splitlines())) > 120
    with open(log, "wb") as out:
        ok = server.popen([sys.executable, "-m", "recover", "--version"], _env(), stdout=out)
        bad = server.popen([sys.executable, "-m", "recover", "launch", "--steps", "x"], _env(), stdout=out,
                           stdin=subprocess.PIPE)
    assert bad.stdin is not None
    bad.stdin.close()
    assert ok.wait(timeout=30) == 0 and bad.wait(timeout=30) == 2
    assert "recover " in log.read_text() and "error" in log.read_text()
    server.proc.kill()
    server.proc.wait(10)
    with open(log, "wb") as out, pytest.raises(forkserver.Unavailable):
        server.popen([sys.executable, "-m", "recover", "--version"], _env(), stdout=out)
    started = spawn([sys.executable, "-m", "recover", "--version"], tmp_path / "b.log", _env(), forks=server)
    assert isinstance(started.proc, subprocess.Popen) and started.proc.wait(timeout=60) == 0
    started.log.close()
    assert "recover " in (tmp_path / "b.log").read_text()
