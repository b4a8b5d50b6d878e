"""Shared fixtures: a small prepared corpus, TLS certificates of a test CA, and a runner for `recover`
subprocesses.

Every subprocess is started in its own session and, if it outlives its timeout, stopped by PID
(never by name): SIGINT to its process group first (a launcher then stops the coordinator and the
workers it started, each in a session of its own), SIGKILL after a grace, so no test leaves
processes behind. ``run_recover`` (and the tests' own ``warmstart.popen``) fork a ``recover`` command from one
warm interpreter per test process instead of starting a new one (:mod:`warmstart`; ``RECOVER_TEST_FRESH=1``: new
ones).

The unit tier is pure and in-process: under tests/unit no process starts. Every way the standard library
starts one ends in ``subprocess.Popen._execute_child`` (subprocess, ``os.popen``), ``multiprocessing``'s
``BaseProcess.start`` (pools and executors too), ``os.fork`` or ``os.posix_spawn``; for each unit test they
raise an OSError (ENOENT) naming the tier a process-starting test belongs in. Code that probes an optional
program (``nvidia-smi``) thus sees a machine without it, the same on every machine; a test that starts a
process fails.
"""

from __future__ import annotations

import errno
import json
import multiprocessing.process
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import warmstart
from recover.bench.common import STOP_GRACE_S, kill_group

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
UNIT = ROOT / "tests" / "unit"
SPAWNERS = ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
            *((os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp") if hasattr(os, name)))


def _no_process(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOENT, "the unit tier starts no process: a test that does belongs in tests/dist "
                  "(tests/e2e for a `recover launch` run)")


def pytest_configure(config: pytest.Config) -> None:
    """Compiles recover's modules once per session, beside their sources (``__pycache__``, as any import that may
    write bytecode does): where the environment says not to write bytecode (``PYTHONDONTWRITEBYTECODE``) every new
    interpreter of the suite would otherwise compile them anew (~0.4 CPU-s each); it still reads them."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled them
        return
    import compileall

    compileall.compile_dir(SRC / "recover", quiet=1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest runs (marked ``long``) first: with the tiers spread over the cores (`make test`'s ``-n auto``),
    one that started last would run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def unit_tier_is_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails a test under tests/unit that starts a process (see the module's docstring)."""
    if UNIT in Path(request.node.path).parents:
        for owner, name in SPAWNERS:
            monkeypatch.setattr(owner, name, _no_process)


NO_PLOTS = "--observe.plots=false"
"""What a test's `recover launch` passes unless the test is about the plots: matplotlib's second of CPU at each
job's end is the suite's to spare (tests/e2e/test_launch.py's reference run draws them and checks them, and
checks that a run asked for none draws none)."""


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_recover(args: list[str], nproc: int | None = None, timeout: float = 240, check: bool = True,
                fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Runs ``recover ARGS`` (under torchrun with ``nproc`` ranks when given) and returns the result; forked from
    the warm interpreter of :mod:`warmstart` unless ``fresh``."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "recover", *args]
    else:
        cmd = [sys.executable, "-m", "recover", *args]
    proc = warmstart.popen(cmd, fresh=fresh, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=subprocess_env(), cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, STOP_GRACE_S)
        out, err = proc.communicate()
        raise AssertionError(f"`recover {' '.join(args)}` timed out after {timeout} s\n{out}\n{err}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"`recover {' '.join(args)}` exited {proc.returncode}\n{out}\n{err}")
    return result


def refusal(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``recover ARGS`` run in this process (for requests that must be refused before anything starts:
    milliseconds instead of a Python start-up each): its exit status and its stderr."""
    from recover.cli import main

    try:
        code = main(args)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    return code, captured.err


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])] = float(rec["loss"])
    return out


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), f"different steps: {sorted(a)} vs {sorted(b)}"
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1.5 MB slice of the stdlib corpus, prepared once per test session."""
    from recover.data import prepare_builtin

    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    prepare_builtin("stdlib", out, max_bytes=1_500_000, quiet=True)
    return out


LEAF = ("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-days", "1", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_leaf(d: Path, name: str, ca: str) -> Any:
    from recover.coord.tls import Tls

    (d / "leaf.ext").write_text(LEAF)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", "leaf.ext", cwd=d)
    return Tls(str(d / f"{name}.pem"), str(d / f"{name}.key"), str(d / "ca.pem"))


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A CA, a certificate it signs for the job's processes (``job``) and one another CA signs
    (``stranger``), made with the ``openssl`` command (the test is skipped where there is none)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make the test's certificates with")
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    return {"job": make_leaf(d, "node", "ca"), "stranger": make_leaf(d, "stranger", "other-ca")}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Ends this test process's warm interpreter (:mod:`warmstart`), if it started one."""
    warmstart.ZYGOTE.close()
