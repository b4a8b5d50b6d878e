"""``recover check``: is this host fit to train with recover? One table, one verdict.

Contract:
- Prints one table of rows (check, result, against the peak, status) and exits 0 when no row failed;
  otherwise one line on stderr names the first failure and what to do, and the exit status is 1. A
  ``warn`` row (a GPU far below its data-sheet peak, a MIG slice, a power cap, deterministic mode
  without deterministic kernels) does not fail the check. ``--json FILE`` writes the rows and the raw
  measurements for scripts.
- Rows: Python, torch, CUDA and NCCL versions; whether NCCL can shrink a communicator
  (:func:`recover.comm.nccl.shrink_supported`) and abort one (``ProcessGroupNCCL.abort``); per visible
  GPU, measured by a child process that sees only it (:mod:`recover.ops.probes`): name and memory,
  a bf16 matmul rate and a copy bandwidth against :mod:`recover.bench.gpu`'s peak tables, an NCCL
  all-reduce on it alone and that communicator's abort; an NCCL all-reduce across every visible GPU
  (one process each) when there are two or more; a gloo all-reduce of 2 processes on 127.0.0.1.
  Without a GPU: a row saying so (not a failure) and the CPU's matmul rate. ``--determinism``: one
  microbatch's gradient in deterministic mode in 2 fresh processes (on GPU 0, else the CPU) must have
  the same exact fingerprint.
- Every child is started in a session of its own, bounded by ``--timeout`` (its collectives' timeout,
  plus :data:`START_S` for the interpreter and CUDA to start), and stopped by its process group, never by
  name. This process imports torch but creates no CUDA context; importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from recover.bench.common import child_env, kill_group, write_json
from recover.bench.gpu import peak_bandwidth, peak_flops
from recover.errors import ConfigError
from recover.ops.probes import MODULE as PROBES

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"
START_S = 30.0
"""Seconds a probe process gets beyond ``--timeout`` to start (interpreter, torch import, CUDA)."""
BELOW_PEAK = 0.5
"""A GPU measured below this fraction of its data-sheet peak gets a warning row."""
GLOO_NUMEL = 1 << 20
NCCL_NUMEL = 1 << 26
SMI_FIELDS = ("uuid", "driver_version", "mig.mode.current", "power.limit", "power.max_limit")
STYLE = {OK: "green", INFO: "cyan", WARN: "yellow", FAIL: "bold red"}


@dataclass
class Row:
    check: str
    result: str
    peak: str = ""
    status: str = OK
    problem: str | None = None
    """With ``warn`` or ``FAIL``: one line saying what is wrong and what to do."""


@dataclass
class Outcome:
    """What a probe process gave: its JSON result, or why there is none."""

    result: dict[str, Any] | None = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- child processes

def probe_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", PROBES, *args]


@dataclass
class Running:
    """Probe processes started together, with their output files and the time they started."""

    procs: list[subprocess.Popen[str]]
    files: list[tuple[Any, Any]]
    t0: float


def start_probes(cmds: Sequence[tuple[list[str], dict[str, str]]]) -> Running:
    """Starts every ``(command, extra environment)``, each in a session of its own."""
    running = Running([], [], time.monotonic())
    try:
        for cmd, env in cmds:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            running.files.append((out, err))
            running.procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True,
                                                  env=child_env(env)))
    except BaseException:
        stop(running)
        raise
    return running


def finish_probes(running: Running, limit_s: float) -> list[Outcome]:
    """Waits up to ``limit_s`` (from their start) for every process; one still running then, or when this
    process is interrupted, is SIGKILLed by its process group."""
    late = []
    try:
        for proc in running.procs:
            try:
                proc.wait(timeout=max(0.0, running.t0 + limit_s - time.monotonic()))
                late.append(False)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                late.append(True)
    finally:
        stop(running)
    seconds = time.monotonic() - running.t0
    return [read_outcome(proc.returncode, out, err, timed_out, seconds)
            for proc, (out, err), timed_out in zip(running.procs, running.files, late, strict=True)]


def stop(running: Running) -> None:
    for proc in running.procs:
        if proc.poll() is None:
            kill_group(proc)


def run_probes(cmds: Sequence[tuple[list[str], dict[str, str]]], limit_s: float) -> list[Outcome]:
    return finish_probes(start_probes(cmds), limit_s)


def read_outcome(code: int, out: Any, err: Any, timed_out: bool, seconds: float) -> Outcome:
    out.seek(0)
    err.seek(0)
    lines = [line for line in out.read().splitlines() if line.strip()]
    errors = [line.strip() for line in err.read().splitlines() if line.strip()]
    out.close()
    err.close()
    if timed_out:
        return Outcome(timed_out=True, seconds=seconds, error="timed out")
    if code == 0 and lines:
        try:
            return Outcome(result=json.loads(lines[-1]), seconds=seconds)
        except json.JSONDecodeError:
            pass
    return Outcome(error=(errors[-1] if errors else f"exit status {code}")[:300], seconds=seconds)


def gpu_env(ids: Sequence[str], index: int) -> dict[str, str]:
    """The environment of a child that sees only GPU ``index`` of this process (``ids``: the visible ones)."""
    return {"CUDA_VISIBLE_DEVICES": ids[index]}


def visible_ids(count: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entry of each GPU this process sees, in torch's order."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in given.split(",") if s.strip()] if given else []
    return ids[:count] if len(ids) >= count else [str(i) for i in range(count)]


# ---------------------------------------------------------------- facts of this host

def host_facts() -> dict[str, Any]:
    """Versions and capabilities, from this process (torch imported, no CUDA context created)."""
    import torch
    import torch.distributed as dist

    from recover.comm.nccl import has_shrink_api, nccl_version, shrink_supported

    version = nccl_version() if dist.is_nccl_available() else None
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    return {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": list(version) if version else None,
            "shrink": shrink_supported(version, has_shrink_api()),
            "abort": hasattr(pg_nccl, "abort") if pg_nccl is not None else None,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "cpus": os.cpu_count(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def nvidia_smi() -> dict[str, dict[str, str]]:
    """``nvidia-smi``'s view of each GPU by UUID (empty without nvidia-smi or when it fails)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        out = subprocess.run([exe, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=False))
            for line in out.stdout.splitlines() if line.strip()]
    return {uuid_key(r["uuid"]): r for r in rows if out.returncode == 0}


def uuid_key(uuid: str) -> str:
    """A GPU's UUID as nvidia-smi (``GPU-...``) and torch (no prefix) both give it."""
    return uuid.lower().removeprefix("gpu-")


# ---------------------------------------------------------------- rows (pure: unit-tested)

def version_rows(f: dict[str, Any]) -> list[Row]:
    gpus = f["gpus"] > 0
    nccl = ".".join(map(str, f["nccl"])) if f["nccl"] else None
    rows = [Row("Python", f"{f['python']} ({f['executable']})", status=INFO),
            Row("torch", f["torch"], status=INFO),
            Row("CUDA", f["cuda"] or "none: a CPU build of torch", status=INFO)]
    if gpus and not nccl:
        rows.append(Row("NCCL", "none", status=FAIL, problem="this torch has no NCCL: recover's groups across GPUs "
                        "need it; install a CUDA build of torch"))
    else:
        rows.append(Row("NCCL", nccl or "none (no GPU: gloo only)", status=OK if nccl else INFO))
    if not nccl:
        shrink = "n/a: no NCCL in this torch"
    else:
        shrink = "yes" if f["shrink"] else "no: a failure rebuilds the communicator (needs NCCL >= 2.27, torch >= 2.10)"
    rows.append(Row("NCCL shrink", shrink, status=OK if f["shrink"] else INFO))
    if f["abort"] is None:
        rows.append(Row("NCCL abort", "n/a: no NCCL in this torch", status=INFO))
    elif f["abort"]:
        rows.append(Row("NCCL abort", "yes (ProcessGroupNCCL.abort)"))
    else:
        rows.append(Row("NCCL abort", "no", status=FAIL if gpus else INFO,
                        problem="ProcessGroupNCCL has no abort: recover cannot drop a failed communicator; "
                                "use a newer torch"))
    return rows


def against(value: float, peak: float | None, unit: float, suffix: str) -> str:
    return f"{value / peak * 100:.0f}% of {peak / unit:,.0f} {suffix}" if peak else "peak unknown"


def gpu_rows(i: int, o: Outcome, smi: dict[str, dict[str, str]], limit_s: float) -> list[Row]:
    """The rows of GPU ``i`` from its probe (and nvidia-smi's view of it, by UUID)."""
    label = f"GPU {i}"
    if o.result is None:
        why = f"timed out after {limit_s:.0f} s" if o.timed_out else f"failed: {o.error}"
        return [Row(label, f"probe {why}", status=FAIL, problem=f"GPU {i} could not be measured ({why}): check "
                    "nvidia-smi for a hung, busy or failed GPU")]
    r = o.result
    name, used = r["name"], r["total_gb"] - r["free_gb"]
    cap = ".".join(map(str, r["capability"]))
    rows = [Row(label, f"{name}, {r['total_gb']:.1f} GiB ({r['free_gb']:.1f} free), sm_{cap.replace('.', '')}, "
                f"{r['sms']} SMs", status=INFO)]
    view = smi.get(uuid_key(r["uuid"]), {})
    rows += gpu_warnings(i, name, used, r["capability"], view)
    tf, bw = r["matmul_flops"], r["copy_bytes_per_s"]
    rows.append(speed_row(f"{label} bf16 matmul", f"{tf / 1e12:,.0f} TFLOP/s ({r['matmul_n']}^3)", tf,
                          peak_flops(name), 1e12, "TFLOP/s",
                          f"GPU {i} runs bf16 matmuls at {{pct}} of its peak: a power cap, low clocks or a MIG slice? "
                          "see nvidia-smi -q -d PERFORMANCE,CLOCK"))
    rows.append(speed_row(f"{label} memory copy", f"{bw / 1e9:,.0f} GB/s ({r['copy_gb']:.2f} GiB on-device)", bw,
                          peak_bandwidth(name), 1e9, "GB/s",
                          f"GPU {i} copies memory at {{pct}} of its bandwidth: low memory clocks or a MIG slice?"))
    rows.append(nccl_alone_row(i, r["nccl"]))
    return rows


def gpu_warnings(i: int, name: str, used_gb: float, capability: Sequence[int],
                 smi: dict[str, str]) -> list[Row]:
    rows = []
    if "MIG" in name or smi.get("mig.mode.current") == "Enabled":
        rows.append(Row(f"GPU {i} MIG", "MIG is on: a slice of the GPU", status=WARN,
                        problem=f"GPU {i} is a MIG slice: data-sheet peaks and MFU do not apply to it"))
    if capability[0] < 8:
        rows.append(Row(f"GPU {i} bf16", f"compute capability {capability[0]}.{capability[1]}", status=WARN,
                        problem=f"GPU {i} has no bf16 tensor cores (sm < 80): bf16 runs are emulated, slowly"))
    if used_gb > 2.0:
        rows.append(Row(f"GPU {i} memory in use", f"{used_gb:.1f} GiB held by other processes", status=WARN,
                        problem=f"GPU {i} has {used_gb:.1f} GiB in use by another process: see nvidia-smi"))
    limit, top = _number(smi.get("power.limit")), _number(smi.get("power.max_limit"))
    if limit and top and limit < 0.9 * top:
        rows.append(Row(f"GPU {i} power", f"capped at {limit:.0f} W of {top:.0f} W", status=WARN,
                        problem=f"GPU {i}'s power limit is {limit:.0f} W of {top:.0f} W: expect lower clocks"))
    if smi.get("driver_version"):
        rows.append(Row(f"GPU {i} driver", smi["driver_version"], status=INFO))
    return rows


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def speed_row(check: str, result: str, value: float, peak: float | None, unit: float, suffix: str,
              low: str) -> Row:
    """A measured rate against its data-sheet peak: ``warn`` below :data:`BELOW_PEAK` of it."""
    if peak and value < BELOW_PEAK * peak:
        return Row(check, result, against(value, peak, unit, suffix), WARN, low.format(pct=f"{value / peak:.0%}"))
    return Row(check, result, against(value, peak, unit, suffix), OK if peak else INFO)


def nccl_alone_row(i: int, r: dict[str, Any]) -> Row:
    if not r.get("ok"):
        return Row(f"GPU {i} NCCL, 1 rank", f"failed: {r.get('error')}", status=FAIL,
                   problem=f"an NCCL all-reduce on GPU {i} alone failed ({r.get('error')}): rerun with NCCL_DEBUG=INFO")
    abort = f", abort {r['abort_ms']:.0f} ms" if "abort_ms" in r else ", no abort"
    return Row(f"GPU {i} NCCL, 1 rank", f"all-reduce ok (connect {r['connect_ms']:.0f} ms{abort})")


def allreduce_row(label: str, what: str, outcomes: Sequence[Outcome], limit_s: float, hint: str) -> Row:
    """One row for the processes of one all-reduce: ok, wrong sum, failed or timed out."""
    late = [o for o in outcomes if o.timed_out]
    failed = [o for o in outcomes if o.result is None and not o.timed_out]
    wrong = [o.result for o in outcomes if o.result is not None and not o.result["ok"]]
    if failed:
        why = f"failed: {failed[0].error}"
    elif late:
        why = f"timed out after {limit_s:.0f} s"
    elif wrong:
        why = f"gave {wrong[0]['got']:g} instead of {wrong[0]['expected']:g}"
    else:
        r = outcomes[0].result or {}
        size = f"{r['bytes'] / 2**20:.0f} MiB"
        return Row(label, f"ok: {size} in {max(o.result['ms'] for o in outcomes if o.result):.1f} ms, "
                   f"bus {r['bus_bytes_per_s'] / 1e9:.1f} GB/s")
    return Row(label, why, status=FAIL, problem=f"{what} {why}: {hint}")


def determinism_row(outcomes: Sequence[Outcome], limit_s: float) -> Row:
    label = "determinism (1 microbatch, 2 runs)"
    bad = [o for o in outcomes if o.result is None]
    if bad:
        why = f"timed out after {limit_s:.0f} s" if bad[0].timed_out else f"failed: {bad[0].error}"
        return Row(label, why, status=FAIL, problem=f"the determinism check {why}")
    a, b = (o.result for o in outcomes)
    assert a is not None and b is not None
    where = f"{a['config']}, {a['dtype']}, {a['device']}"
    if a["fp"] != b["fp"]:
        return Row(label, f"{a['fp']} vs {b['fp']} ({where})", status=FAIL,
                   problem=f"deterministic mode is not reproducible on {a['device']}: one microbatch's gradient "
                           f"fingerprint differs between two processes ({a['fp']} vs {b['fp']}); a kernel is not "
                           "deterministic: see torch.use_deterministic_algorithms")
    if not a["deterministic_algorithms"]:
        return Row(label, f"same fingerprint {a['fp']} ({where})", status=WARN,
                   problem="deterministic mode leaves torch.use_deterministic_algorithms off: it reproduced here, "
                           "but by the kernels' luck")
    return Row(label, f"same fingerprint {a['fp']} ({where}; deterministic kernels on)")


def verdict(rows: Sequence[Row]) -> tuple[int, str | None]:
    """Exit status and the one line naming what failed (None when nothing did)."""
    failed = [r for r in rows if r.status == FAIL]
    if not failed:
        return 0, None
    more = f" (and {len(failed) - 1} more failed row(s): see the table)" if len(failed) > 1 else ""
    return 1, f"{failed[0].problem or failed[0].check + ': ' + failed[0].result}{more}"


# ---------------------------------------------------------------- the checks

def check_gpus(count: int, args: argparse.Namespace, say: Callable[[str], None]) -> tuple[list[Row], list[Any]]:
    """Each GPU measured by a child of its own, all at once (each on its own device)."""
    ids = visible_ids(count)
    say(f"measuring {count} GPU(s): bf16 matmul, memory copy, NCCL on each")
    limit = args.timeout + START_S
    cmds = [(probe_cmd("gpu", "--n", str(args.matmul_size), "--timeout", str(args.timeout)), gpu_env(ids, i))
            for i in range(count)]
    outcomes = run_probes(cmds, limit)
    smi = nvidia_smi()
    rows = [row for i, o in enumerate(outcomes) for row in gpu_rows(i, o, smi, limit)]
    return rows, [o.result or {"error": o.error, "timed_out": o.timed_out} for o in outcomes]


def allreduce_cmds(backend: str, world: int, numel: int, timeout_s: float,
                   envs: Sequence[dict[str, str]]) -> tuple[Any, list[tuple[list[str], dict[str, str]]]]:
    """A TCPStore on 127.0.0.1 (hosted here, kept alive by the caller) and one command per rank."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    cmds = [(probe_cmd("allreduce", "--backend", backend, "--port", str(store.port), "--rank", str(r), "--world",
                       str(world), "--numel", str(numel), "--timeout", str(timeout_s)), envs[r]) for r in range(world)]
    return store, cmds


def determinism_cmds(gpus: int) -> list[tuple[list[str], dict[str, str]]]:
    device, config, dtype = ("cuda", "125m", "bfloat16") if gpus else ("cpu", "debug", "float32")
    env = gpu_env(visible_ids(gpus), 0) if gpus else {}
    cmd = probe_cmd("gradfp", "--config", config, "--device", device, "--dtype", dtype)
    return [(cmd, env), (cmd, env)]


def run_checks(args: argparse.Namespace, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every check; the gloo processes (and without GPUs the determinism ones) start first, so that their
    start-up overlaps this process's own checks."""
    import torch

    from recover.ops.probes import cpu_matmul_flops

    t0 = time.monotonic()
    limit = args.timeout + START_S
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    store, cmds = allreduce_cmds("gloo", 2, GLOO_NUMEL, args.timeout, [{}, {}])
    det = determinism_cmds(n) if args.determinism and not n else []  # no GPU to disturb: at once
    background = start_probes(cmds + det)
    facts = host_facts()
    rows = version_rows(facts)
    res: dict[str, Any] = {"host": facts}
    if n:
        gpu, res["gpus"] = check_gpus(n, args, say)
        rows += gpu
    say("gloo all-reduce of 2 processes on 127.0.0.1" + (", determinism" if det else ""))
    outcomes = finish_probes(background, limit)
    del store
    if not n:
        rows.append(Row("GPUs", "none visible: checking the CPU path (gloo, CPU matmul)", status=INFO))
        cpu = res["cpu_matmul"] = cpu_matmul_flops()
        rows.append(Row("CPU matmul", f"{cpu['flops'] / 1e9:,.0f} GFLOP/s (float32 {cpu['n']}^3, "
                        f"{cpu['threads']} thread(s) of {facts['cpus']} cores)", status=INFO))
    rows.append(allreduce_row("gloo all-reduce, 2 processes", "the gloo all-reduce of 2 processes on 127.0.0.1",
                              outcomes[:2], limit, "check TCP on the loopback (firewall, GLOO_SOCKET_IFNAME)"))
    if n >= 2:
        rows.append(nccl_across(n, args.timeout, limit, say))
    if args.determinism:
        if n:
            say("determinism: one microbatch's gradient on GPU 0, twice")
        det_outcomes = run_probes(determinism_cmds(n), limit) if n else outcomes[2:]
        rows.append(determinism_row(det_outcomes, limit))
        res["determinism"] = [o.result or {"error": o.error} for o in det_outcomes]
    code, line = verdict(rows)
    res.update({"ok": code == 0, "failure": line, "rows": [asdict(r) for r in rows],
                "elapsed_s": round(time.monotonic() - t0, 2)})
    return res


def nccl_across(n: int, timeout_s: float, limit_s: float, say: Callable[[str], None]) -> Row:
    """An NCCL all-reduce of one process per visible GPU."""
    names = ",".join(map(str, range(n)))
    say(f"NCCL all-reduce across GPUs {names}")
    envs = [gpu_env(visible_ids(n), i) for i in range(n)]
    store, cmds = allreduce_cmds("nccl", n, NCCL_NUMEL, timeout_s, envs)
    outcomes = run_probes(cmds, limit_s)
    del store
    return allreduce_row(f"NCCL all-reduce, GPUs {names}", f"the NCCL all-reduce across GPUs {names}", outcomes,
                         limit_s, "check NVLink/IB (nvidia-smi topo -m), rerun with NCCL_DEBUG=INFO")


# ---------------------------------------------------------------- command line

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check this host: versions, each GPU's speed against its peak, NCCL and gloo all-reduces",
        description="Checks that this host can train with recover and prints one table: Python, torch, CUDA and "
                    "NCCL versions, NCCL shrink and abort, per GPU its bf16 matmul rate and memory bandwidth "
                    "against the data sheet and an NCCL all-reduce, an NCCL all-reduce across the GPUs and a gloo "
                    "one across 2 processes (the CPU path without GPUs). Exit status 0 when nothing failed, "
                    "1 with one line naming the failure.")
    p.add_argument("--determinism", action="store_true",
                   help="also compute one microbatch's gradient in deterministic mode in 2 fresh processes and "
                        "require the same exact fingerprint")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds each collective may take (default 30); a probe process gets 30 s more to start")
    p.add_argument("--matmul-size", type=int, default=8192, metavar="N",
                   help="GPU matmul size N (N x N by N x N in bf16; default 8192)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows and measurements to FILE")
    p.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise ConfigError(f"recover check: --timeout {args.timeout} is not allowed: give seconds > 0")
    if args.matmul_size < 512:
        raise ConfigError(f"recover check: --matmul-size {args.matmul_size} is too small to measure: give N >= 512")
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("recover check") as status:
        res = run_checks(args, say=lambda msg: status.update(f"recover check: {msg}"))
    print_table(res)
    if args.json:
        write_json(args.json, res)
    if res["failure"]:
        print(f"recover check: {res['failure']}", file=sys.stderr)
        return 1
    return 0


def print_table(res: dict[str, Any]) -> None:
    """The rows as one rich table on stdout, then each warning's line and the time taken."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="recover check", title_justify="left")
    for col in ("check", "result", "against the peak", "status"):
        table.add_column(col, no_wrap=col != "result")
    for r in res["rows"]:
        table.add_row(escape(r["check"]), escape(r["result"]), escape(r["peak"]),
                      f"[{STYLE[r['status']]}]{r['status']}[/]")
    cells = [[r["check"], r["result"], r["peak"], r["status"]] for r in res["rows"]]
    needed = sum(max(len(c[i]) for c in cells) + 3 for i in range(4)) + 1 if cells else 0
    terminal = Console()
    console = Console(width=terminal.width if terminal.is_terminal else max(120, needed))  # a log: one line a row
    console.print(table)
    for r in res["rows"]:
        if r["status"] == WARN and r["problem"]:
            console.print(f"warning: {escape(r['problem'])}", highlight=False)
    console.print(f"{len(res['rows'])} checks in {res['elapsed_s']:.1f} s", highlight=False)
