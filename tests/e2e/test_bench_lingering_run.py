"""A run that lingers after its work cannot hang a benchmark (:func:`recover.bench.common.run_child`): its
processes' stacks are dumped into its log, every process of its tree is killed (one in a session of its own
too), and its status says so (``LINGERED``), within the linger bound."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from recover.bench.common import LINGERED, committed, run_child

LINGERER = """
import faulthandler, json, signal, subprocess, sys, time
from pathlib import Path
faulthandler.register(signal.SIGUSR2, all_threads=True)
run = Path(sys.argv[1])
# a helper in a session of its own (as a runner's workers are): it must not outlive the run
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
(run / "helper.pid").write_text(str(helper.pid))
with open(run / "metrics.jsonl", "w") as f:
    for step in range(3):
        f.write(json.dumps({"step": step, "loss": 1.0}) + "\\n")
def stuck_in_teardown():
    time.sleep(600)
stuck_in_teardown()
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return " Z " in stat  # a zombie awaiting its reaper ran its last


def test_a_run_that_lingers_after_its_work_is_stopped_with_its_stacks_and_marked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "run.log"
    t0 = time.monotonic()
    code = run_child([sys.executable, "-c", LINGERER, str(run)], log, timeout_s=120, done=committed(run, 3),
                     linger_s=1.0)
    took = time.monotonic() - t0
    assert code == LINGERED and took < 30, (code, took, log.read_text()[-2000:])
    text = log.read_text()
    assert "the run's work is done but processes" in text and "stuck_in_teardown" in text  # its stack
    helper = int((run / "helper.pid").read_text())
    deadline = time.monotonic() + 5
    while not _gone(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(helper)  # killed although it was in a session of its own


