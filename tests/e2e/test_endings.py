"""End to end: every way a job ends that its environment or its last replica forces is one line and a
documented exit status, never a traceback or a bare status (issue 41): the last live replica hung with
no replacement to come, the run directory removed under the running job, a training shard truncated
under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_storage import FULL_AT_SUMMARY  # a launcher whose summary.json the disk refuses

import warmstart
from conftest import NO_PLOTS, ROOT, STOP_GRACE_S, kill_group, subprocess_env
from recover.observe.events import read_jsonl
from recover.train.checkpoints.integrity import list_checkpoints


def start(out: Path, corpus: Path, *flags: str) -> subprocess.Popen[str]:
    """``recover launch`` of the debug model in the background (its own session: killed by group at the end)."""
    cmd = [sys.executable, "-m", "recover", "launch", NO_PLOTS, "--config", "debug", "--out", str(out), "--no-progress",
           "--data.path", str(corpus), "--device-time-s", "0.05", *flags]
    return warmstart.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=ROOT, start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str]:
    """The launcher's exit status and stderr (it is killed, with its group, past ``timeout``)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, STOP_GRACE_S)
        _, err = proc.communicate()
        raise AssertionError(f"the launcher did not end within {timeout} s\n{err}") from None
    return proc.returncode, err


def wait_for(what: str, check: object, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def committed(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(list(read_jsonl(path))) if path.is_file() else 0


def _cmdlines() -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
    return out


def worker_pid(out: Path, replica: int) -> int:
    """The PID of the ``recover worker`` process of ``replica`` in the run ``out`` (found as operators do:
    its command line holds ``recover worker``, ``--out OUT`` and ``--replica R``)."""
    for pid, args in _cmdlines().items():
        if "worker" in args and str(out) in args and "--replica" in args and args[args.index("--replica") + 1] \
                == str(replica):
            return pid
    raise AssertionError(f"no worker of replica {replica} of {out}")


def coordinator_pid(out: Path) -> int:
    """The PID of the run's ``recover coordinator`` (its command line holds a path inside ``out``)."""
    for pid, args in _cmdlines().items():
        if "coordinator" in args and any(a.startswith(str(out)) for a in args):
            return pid
    raise AssertionError(f"no coordinator of {out}")


def endings(err: str) -> list[str]:
    """The launcher's own lines (``recover: ...``) about how the job ended, warnings left out."""
    return [line for line in err.splitlines() if line.startswith("recover: ") and "warning" not in line]


def test_the_last_live_replica_hung_without_rejoins_ends_with_status_3_naming_the_checkpoint_and_resume(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: found in 2 s, then status 1 and no line, though a checkpoint existed
    out = tmp_path / "run"
    proc = start(out, corpus, "--replicas", "1", "--steps", "200", "--training.checkpoint_every=2",
                 "--fault_tolerance.hang_timeout_s=5")  # 2 s: a step slowed by a loaded machine was a hang
    try:
        wait_for("a checkpoint", lambda: len(list_checkpoints(out / "checkpoints")) >= 1 and committed(out) >= 3)
        os.kill(worker_pid(out, 0), signal.SIGUSR1)  # its training thread stops for good; heartbeats go on
    finally:
        code, err = finish(proc)
    newest = list_checkpoints(out / "checkpoints")[-1]
    assert code == 3, err[-3000:]
    assert "Traceback" not in err
    assert endings(err) == [
        f"recover: the job stopped: every replica was lost (replica 0 hung) and none was to come back "
        f"(no --rejoin-after); the newest complete checkpoint is {newest[1]} (step {newest[0]}): continue "
        "with the same command and --resume, redoing the steps after it"], err[-3000:]


def test_the_run_directory_removed_under_the_running_job_is_created_again_and_the_job_goes_on(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: the launcher died with FileNotFoundError opening logs/spare_1.log at the next kill
    import shutil

    out = tmp_path / "run"
    proc = start(out, corpus, "--replicas", "2", "--steps", "24", "--fail", "1@14:forward", "--rejoin-after", "0.3",
                 "--training.checkpoint_every=4")
    try:
        wait_for("step 4", lambda: committed(out) >= 4)
        while out.exists():  # the workers write on meanwhile: remove until nothing is left
            shutil.rmtree(out, ignore_errors=True)
    finally:
        code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("recover: ")] == [
        f"recover: warning: the run directory {out} was removed while the job ran; created again (logs/, replicas/, "
        f"config.json, the token) at step {err.split(' the token) at step ')[1].split(':')[0]}: the job goes on, but "
        "the checkpoints, logs and events written before are gone"], err[-3000:]
    rows = list(read_jsonl(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(24)) and {r["microbatches"] for r in rows} == {8}
    events = list(read_jsonl(out / "events.jsonl"))
    assert [e["kind"] for e in events].count("run_dir_recreated") == 1
    assert any(e["kind"] == "state_received" and e["replica"] == 1 for e in events)  # the rejoin after the removal
    assert list_checkpoints(out / "checkpoints")[-1][0] == 24  # saves go on into the new directory


def test_a_training_shard_cut_short_under_the_running_job_is_bad_data_status_10_naming_the_file(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: every worker died of SIGBUS within 0.1 s, status 1, no line, no rejoin
    import shutil

    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    shard = sorted(data.glob("train*.bin"))[0]
    out = tmp_path / "run"
    proc = start(out, data, "--replicas", "2", "--steps", "200", "--rejoin-after", "1",
                 "--training.checkpoint_every=2")
    try:
        wait_for("step 3", lambda: committed(out) >= 3)
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(2048)  # the header and a few hundred tokens left: the next windows past them are gone
    finally:
        code, err = finish(proc)
    assert code == 10, err[-3000:]
    assert "Traceback" not in err
    line = [line for line in err.splitlines() if line.startswith("recover: ")]
    assert len(line) == 1 and line[0].startswith(
        f"recover: the job stopped on bad data: {shard}: shard changed on disk during the run ({size} bytes when "
        "opened, now 2048)"), err[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("replica_*.log"))
    assert "Traceback" not in logs and "SIGBUS" not in logs


@pytest.mark.long
def test_a_torn_metrics_file_then_resume_recovers_the_committed_steps_from_the_replicas_logs(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: the record of the last step inside the checkpoint was gone for good: "59 steps committed", status 1
    import shutil

    from conftest import run_recover

    def launch(out: Path, steps: int, *flags: str) -> subprocess.CompletedProcess[str]:
        return run_recover(["launch", NO_PLOTS,
                            "--config", "debug", "--replicas", "2", "--steps", str(steps), "--out", str(out),
                            "--no-progress", "--data.path", str(corpus), "--deterministic",
                            "--training.checkpoint_every=3", *flags], timeout=300, check=False)

    first = tmp_path / "first"
    assert launch(first, 6).returncode == 0
    torn = (first / "metrics.jsonl").read_bytes()
    before = {r["step"]: r for r in read_jsonl(first / "metrics.jsonl")}
    (first / "metrics.jsonl").write_bytes(torn[:torn.rstrip(b"\n").rfind(b"\n") + 40])  # step 5's line torn
    lost = tmp_path / "lost"
    shutil.copytree(first, lost)
    for log in (lost / "replicas").glob("*.jsonl"):
        log.unlink()  # and no replica log to recover it from

    res = launch(first, 9, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["step"]: r for r in read_jsonl(first / "metrics.jsonl")}
    assert sorted(rows) == list(range(9))
    assert {s: rows[s]["loss"] for s in range(6)} == {s: before[s]["loss"] for s in range(6)}  # step 5 recovered
    assert rows[5]["microbatches"] == 8 and abs(rows[5]["elapsed_s"] - before[5]["elapsed_s"]) < 0.5

    res = launch(lost, 9, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [line for line in res.stderr.splitlines() if line.startswith("recover: ")] == [
        "recover: warning: the records of committed steps 5 are lost (metrics.jsonl torn and no replica log holds "
        "them); the steps are in the checkpoint, their records stay missing from metrics.jsonl"]
    assert [r["step"] for r in read_jsonl(lost / "metrics.jsonl")] == [0, 1, 2, 3, 4, 6, 7, 8]


def test_a_worker_out_of_file_descriptors_is_fenced_as_the_fault_and_the_job_goes_on(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: with `ulimit -n` exhausted on one worker, then another replica killed, one step took 86 s (5
    # generations with the same members, a 60 s collective timeout) and the worker died with a traceback
    out = tmp_path / "run"
    proc = start(out, corpus, "--replicas", "3", "--steps", "40", "--fault_tolerance.collective_timeout_s=20")
    try:
        wait_for("step 3", lambda: committed(out) >= 3)
        pid = worker_pid(out, 2)
        # what it holds stays open, nothing new opens: its next group's sockets are refused (EMFILE)
        subprocess.run(["prlimit", f"--pid={pid}", "--nofile=8:8"], check=True)
        at = committed(out)
        os.kill(worker_pid(out, 0), signal.SIGKILL)
    finally:
        code, err = finish(proc)
    events = list(read_jsonl(out / "events.jsonl"))
    rows = list(read_jsonl(out / "metrics.jsonl"))
    assert code == 0, err[-3000:]
    assert [r["step"] for r in rows] == list(range(40)) and {r["microbatches"] for r in rows} == {8}
    slowest = max(r["time_s"] for r in rows[at:])
    assert slowest < 15, slowest  # within the step's budget, not a collective timeout
    # replica 2 alone is fenced as the fault: by the barren rule (its own collectives failed in 3 generations in
    # a row while every peer answered), or first by the link rule when a peer's probe found that it cannot
    # accept a connection either (which of the two acts first depends on how soon replica 0's death is seen)
    fenced = {e["replica"] for e in events if e["kind"] in ("barren_reports", "fenced")}
    assert fenced == {2}, [e for e in events if e["kind"] in ("generation", "failure_report", "fenced")]
    assert {e["replica"] for e in events if e["kind"] == "failure_detected"} == {0, 2}
    log = (out / "logs" / "replica_2.log").read_text(errors="replace")
    assert "Traceback" not in err + log and "fenced by the coordinator" in log


def _kill_replica_1(out: Path) -> None:
    os.kill(worker_pid(out, 1), signal.SIGKILL)


def _hang_replica_0(out: Path) -> None:
    os.kill(worker_pid(out, 0), signal.SIGUSR1)


def _stop_launcher(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)


def _pause_coordinator(out: Path) -> None:
    os.kill(coordinator_pid(out), signal.SIGSTOP)  # for good: the launcher kills it at the end


def _cut_shard(data: Path) -> None:
    with open(sorted(data.glob("train*.bin"))[0], "r+b") as f:
        f.truncate(2048)


LONG = ("--steps", "200", "--training.eval_every=0")
STATUSES = {  # status: (launch flags, what is done to the running job after step 3, the line it ends with)
    0: (("--replicas", "2", "--steps", "3"), None, r"^3 steps committed in .* outputs in "),
    2: (("--training.lr", "inf"), None, r"^recover: error: training.lr = inf is not allowed: a finite number$"),
    3: (("--replicas", "2", "--fault_tolerance.min_replicas=2", "--training.checkpoint_every=2", *LONG),
        _kill_replica_1, r"^recover: the job stopped because too few replicas survived; a complete checkpoint was "
                         r"saved under "),
    6: (("--replicas", "2", *LONG), _stop_launcher,
        r"^recover: the job stopped on request after \d+ committed steps; a complete checkpoint is under .*; "
        r"continue with the same command and --resume$"),
    7: (("--replicas", "2", "--fault_tolerance.coordinator_reconnect_s=2", *LONG), _pause_coordinator,
        r"^recover: the job stopped because the coordinator did not come back after \d+ committed steps; a "
        r"complete checkpoint is under .*--resume$"),
    8: (("--replicas", "2", "--corrupt", "1@4", *LONG), None,
        r"^recover: the job stopped: the replicas' parameters disagree at step 4 with no majority to trust"),
    9: (("--replicas", "2", "--workload.policy=even", "--nan", "0@4:2", "--nan", "1@4:2", *LONG), None,
        r"^recover: the job stopped: microbatch 2 of step 4 was not finite on replicas \[\d, \d\]: the training "
        r"diverged"),
    10: (("--replicas", "2", "--rejoin-after", "1", *LONG), _cut_shard,
         r"^recover: the job stopped on bad data: .*train.*\.bin: shard changed on disk during the run \(\d+ bytes "
         r"when opened, now 2048\)"),
    11: (("--replicas", "1", "--fault_tolerance.hang_timeout_s=2", *LONG), _hang_replica_0,
         r"^recover: the job stopped: every replica holding the training state was lost and there was no complete "
         r"checkpoint under .* to fall back to; start it afresh"),
    12: (("--replicas", "2", "--steps", "3"), None,
         r"^recover: the storage refused the launcher's records with 3 committed steps recorded: could not write "
         r".*summary\.json \(.*No space left on device\); free some space and run `recover collect "),
    1: (("--replicas", "1", "--steps", "3", "--", sys.executable, "-c", "raise SystemExit(1)"), None,
        r"^replica 0 exited with 1:$"),
}
"""Every status of the README's table, each provoked for real through ``recover launch``."""


@pytest.mark.parametrize("status", list(STATUSES))
def test_every_documented_exit_status_is_provoked_for_real_and_ends_with_its_line(
        status: int, corpus: Path, tmp_path: Path) -> None:
    import re
    import shutil

    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"^  \| {status} \| ", readme, re.M), f"status {status} is not in the README's table"
    flags, act, line = STATUSES[status]
    data = tmp_path / "data"
    shutil.copytree(corpus, data)  # a copy: one case cuts a shard
    out = tmp_path / "run"
    pre = [sys.executable, "-c", FULL_AT_SUMMARY] if status == 12 else [sys.executable, "-m", "recover"]
    script = list(flags[flags.index("--"):]) if "--" in flags else []
    flags = flags[:len(flags) - len(script)]
    cmd = [*pre, "launch", NO_PLOTS, "--config", "debug", "--out", str(out), "--no-progress", "--data.path", str(data),
           "--device-time-s", "0.02", *flags, *script]
    proc = warmstart.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=ROOT, start_new_session=True)
    try:
        if act is not None:
            wait_for("step 3", lambda: committed(out) >= 3)
            act(proc) if act is _stop_launcher else act(data if act is _cut_shard else out)  # type: ignore[arg-type]
        stdout, err = proc.communicate(timeout=240)
    except BaseException:
        kill_group(proc, STOP_GRACE_S)
        raise
    assert proc.returncode == status, (stdout + err)[-3000:]
    said = [ln for ln in (stdout + err).splitlines() if re.search(line, ln)]
    assert said, f"no line matching {line!r} in\n{(stdout + err)[-3000:]}"
    assert "Traceback" not in stdout + err
    for log in sorted((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []:  # the coordinator's, workers'
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"


def test_a_learning_rate_that_sends_every_replica_to_infinity_is_a_divergence_status_9(
        corpus: Path, tmp_path: Path) -> None:
    # issue 41: every replica was fenced in turn as `nonfinite` at step 1, logs with a RuntimeError traceback
    from conftest import run_recover

    out = tmp_path / "run"
    res = run_recover(["launch", NO_PLOTS, "--config", "debug", "--replicas", "3", "--steps", "6", "--out", str(out),
                       "--no-progress", "--data.path", str(corpus), "--training.lr", "1e30",
                       "--training.warmup_steps", "0"], timeout=300, check=False)
    assert res.returncode == 9, res.stderr[-3000:]
    assert [line for line in res.stderr.splitlines() if line.startswith("recover: ")] == [
        "recover: the job stopped: the microbatches of step 1 were not finite on every replica [0, 1, 2]: the "
        f"training diverged; the last committed state is under {out / 'checkpoints'}"], res.stderr[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert "Traceback" not in logs + res.stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]  # the last committed state


def test_a_run_directory_replaced_by_a_file_under_the_job_stops_it_in_lines_without_a_traceback(
        corpus: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "run"
    proc = start(out, corpus, "--replicas", "2", *LONG)
    try:
        wait_for("step 3", lambda: committed(out) >= 3)
        while out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        out.write_text("not a directory")  # nothing can be created under it again
    finally:
        code, err = finish(proc)
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("recover: ") and "warning" not in line]
    assert lines and lines[0].startswith(f"recover: the run directory {out} was removed while the job ran and cannot "
                                         "be created again"), err[-3000:]
    assert code == 12 and any("without its final checkpoint" in line for line in lines), err[-3000:]  # nowhere
