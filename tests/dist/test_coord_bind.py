"""`recover coordinator` on a port another process holds: one line naming that port, its flag and the fix."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import warmstart

from conftest import subprocess_env


@pytest.mark.parametrize("flag", ["--port", "--store-port"])
def test_a_taken_port_is_refused_naming_it_and_the_fix(tmp_path: Path, flag: str) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)  # as a job's token is: one other users can read is named in a warning line
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--store-port": "0", flag: str(port)}
        done = warmstart.run([sys.executable, "-m", "recover", "coordinator", "--token-file", str(token),
                               *(x for kv in ports.items() for x in kv)],
                              capture_output=True, text=True, timeout=120, env=subprocess_env())
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"recover: error: cannot bind 127.0.0.1:{port} ({flag}): another process holds it; give "
                        f"another {flag} (0 picks a free one), or end the process holding it (`ss -ltnp "
                        f"'sport = :{port}'` names it)")


def test_the_launcher_names_why_its_coordinator_exited_at_start(tmp_path: Path) -> None:
    from recover.config import load_config
    from recover.errors import RecoverError
    from recover.launch.job import LaunchOptions
    from recover.launch.placement import parse_gpus, place
    from recover.launch.processes import spawn
    from recover.launch.supervisor import Supervisor
    from recover.observe.events import EventLog

    (tmp_path / "logs").mkdir()
    opts = LaunchOptions(config=load_config("debug", []), out=tmp_path, placement=place(1, 1, parse_gpus("0")))
    sup = Supervisor(opts, EventLog(tmp_path / "events.jsonl"), say=print)
    line = "recover: error: cannot bind 127.0.0.1:29400 (--port): another process holds it"
    sup.coordinator = spawn(["sh", "-c", f"echo '{line}'; exit 2"], tmp_path / "logs" / "coordinator.log", {})
    sup.coordinator.proc.wait(10)
    with pytest.raises(RecoverError, match=re.escape(f"the coordinator exited with 2 ({line}); see ")):
        sup._await_coordinator()
