"""``make gpu-check``: everything one GPU can verify and measure, run in stages, into one report.

Contract:
- ``python -m recover.ops.gpucheck --device cuda|cpu --out DIR`` runs the stages of :func:`plan` one
  after another, each as a child process (``recover ...`` or ``pytest``, with this checkout's ``src``
  first on ``PYTHONPATH``) bounded by its time limit and stopped by its process group
  (:func:`recover.bench.common.run_child`); each one's output goes to ``DIR/<stage>.log``.
- Before any stage, the interpreter must import what the stages need (:data:`NEEDED`): otherwise one
  line names what is missing and the exit status is 2.
- A stage that fails (non-zero exit, time limit) is recorded and the next stage still runs. A stage
  that cannot run here is skipped with its reason (``--device cpu``: no GPU); a skip is not a failure.
- ``DIR/REPORT.md`` is rewritten after every stage (an interrupted run leaves what it had), and its path
  is printed at the end. The exit status is 0 when no stage failed, 1 otherwise.
- Stages, on a GPU: ``recover check --determinism`` (versions, the GPU against its peaks, NCCL and
  gloo all-reduces, one microbatch's gradient reproduced bit for bit in deterministic mode);
  ``pytest tests/e2e/test_gpu.py -rs``; ``recover bench gpu`` of ``125m`` and ``1b`` with compiled
  blocks, then eager with the kill-and-rejoin run (2 replicas sharing the GPU over gloo). On the CPU:
  the same check and tests (their skips recorded), the benchmark's CPU smoke run with its kill and
  rejoin; the compiled benchmark is skipped.
- ``--quick`` fits a short GPU lease (about 8 minutes on one H100/H200): the same check and tests, then
  only ``125m`` eager (8 steps, 3 warm-up) with the kill and rejoin; the compiled benchmark is skipped
  (the e2e stage still compiles one model).
- This process never imports torch: the interpreter's CUDA context belongs to the stages.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.bench.common import recover_cmd, run_child

ROOT = Path(__file__).resolve().parents[3]
E2E_GPU = ROOT / "tests" / "e2e" / "test_gpu.py"
MODULE = "recover.ops.gpucheck"
LOG_TAIL = 15
PASSED, FAILED, SKIPPED = "passed", "FAILED", "skipped"
NEEDED = ("torch", "numpy", "rich", "matplotlib", "pytest")
"""What the stages import: recover's dependencies (pyproject.toml) and pytest."""


@dataclass(frozen=True)
class Stage:
    key: str
    """Its name in file names (``DIR/<key>.log``, ``DIR/<key>.json``)."""
    title: str
    cmd: tuple[str, ...] = ()
    timeout_s: float = 600.0
    skip: str | None = None
    """Why it does not run here (None: it runs)."""
    result_json: bool = False
    """Whether the command writes ``DIR/<key>.json`` (rendered into the report)."""


@dataclass
class Done:
    stage: Stage
    status: str
    seconds: float = 0.0
    code: int | None = None


def bench_cmd(out: Path, key: str, *flags: str) -> tuple[str, ...]:
    return tuple(recover_cmd("bench", "gpu", *flags, "--out", str(out / key), "--json", str(out / f"{key}.json")))


def plan(device: str, out: Path, e2e: Path = E2E_GPU, quick: bool = False) -> list[Stage]:
    """The stages of a run on ``device`` writing into ``out`` (``quick``: see the module's docstring)."""
    gpu = device == "cuda"
    no_gpu = "no CUDA GPU visible to this interpreter"
    check_cmd = recover_cmd("check", "--determinism", "--json", str(out / "check.json"))
    check = Stage("check", "recover check --determinism", tuple(check_cmd), 600, result_json=True)
    tests = Stage("e2e-gpu", "pytest tests/e2e/test_gpu.py -rs",
                  (sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(e2e)), 1200,
                  skip=None if e2e.exists() else f"{e2e} not found: run make gpu-check in a source checkout")
    presets = "125m" if quick else "125m,1b"
    gpu_bench = ("--presets", presets, "--steps", "8" if quick else "12", "--warmup", "3" if quick else "4",
                 "--rounds", "1")
    compiled = Stage("bench-compiled", f"recover bench gpu {presets}, compiled blocks",
                     bench_cmd(out, "bench-compiled", *gpu_bench, "--compile", "--no-kill"), 1500,
                     skip="--quick" if quick else None if gpu else
                     f"{no_gpu} (inductor on a CPU takes minutes per preset)", result_json=True)
    if gpu:
        eager = Stage("bench-eager", f"recover bench gpu {presets}, eager, then a kill and a rejoin on 125m",
                      bench_cmd(out, "bench-eager", *gpu_bench, "--no-compile", "--kill"), 1200, result_json=True)
    else:
        eager = Stage("bench-eager", "recover bench gpu --device cpu (smoke: debug preset, a kill and a rejoin)",
                      bench_cmd(out, "bench-eager", "--device", "cpu", "--presets", "debug", "--no-compile", "--dtype",
                                "float32", "--steps", "4", "--warmup", "1", "--rounds", "1"), 600, result_json=True)
    return [check, tests, compiled, eager]


def run_stage(stage: Stage, out: Path) -> Done:
    if stage.skip:
        return Done(stage, SKIPPED)
    log = out / f"{stage.key}.log"
    log.unlink(missing_ok=True)
    t0 = time.monotonic()
    code = run_child(stage.cmd, log, stage.timeout_s)
    return Done(stage, PASSED if code == 0 else FAILED, time.monotonic() - t0, code)


# ---------------------------------------------------------------- the report (pure: unit-tested)

def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(map(cell, row)) + " |" for row in rows)]


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def load_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def log_tail(path: Path, n: int = LOG_TAIL) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return [line.rstrip() for line in lines if line.strip()][-n:]


def pytest_lines(path: Path) -> list[str]:
    """pytest's skip, failure and summary lines from its log."""
    lines = log_tail(path, 400)
    keep = [x for x in lines if x.startswith(("SKIPPED", "FAILED", "ERROR", "XFAIL"))]
    summary = [x for x in lines if (" passed" in x or " skipped" in x or " failed" in x or " error" in x)
               and " in " in x and not x.startswith(("SKIPPED", "FAILED", "ERROR"))]
    return keep + summary[-1:]


def check_section(res: dict[str, Any]) -> list[str]:
    rows = [[r["check"], r["result"], r["peak"], r["status"]] for r in res["rows"]]
    lines = md_table(["check", "result", "against the peak", "status"], rows)
    lines += [""] + [f"- warning: {r['problem']}" for r in res["rows"] if r["status"] == "warn" and r["problem"]]
    if res.get("failure"):
        lines.append(f"- **failure**: {res['failure']}")
    return lines


def bench_section(res: dict[str, Any]) -> list[str]:
    from recover.bench.gpu import result_rows

    columns, rows, notes = result_rows(res)
    return [*md_table(columns, rows), "", *(f"- {note}" for note in notes)]


def stage_section(i: int, d: Done, out: Path) -> list[str]:
    s = d.stage
    lines = [f"## {i}. {s.title}", ""]
    if d.status == SKIPPED:
        return [*lines, f"Skipped: {s.skip}.", ""]
    log = out / f"{s.key}.log"
    lines.append(f"`{' '.join(Path(c).name if j == 0 else c for j, c in enumerate(s.cmd))}`: "
                 f"**{d.status}** (exit {d.code}) in {duration(d.seconds)}; log `{log.name}`")
    lines.append("")
    res = load_json(out / f"{s.key}.json") if s.result_json else None
    if res and s.key == "check":
        lines += check_section(res)
    elif res:
        lines += bench_section(res)
    elif s.key == "e2e-gpu":
        lines += ["```text", *pytest_lines(log), "```"]
    if d.status == FAILED:
        if d.code == 124:
            lines.append(f"Stopped at its time limit ({duration(s.timeout_s)}).")
        lines += ["", f"Last lines of `{log.name}`:", "", "```text", *log_tail(log), "```"]
    return [*lines, ""]


def environment(device: str, check: dict[str, Any] | None) -> list[str]:
    host = (check or {}).get("host", {})
    gpus = (check or {}).get("gpus") or []
    names = sorted({g.get("name", "?") for g in gpus})
    if device == "cuda":
        mode = f"GPU: {len(gpus)} x {', '.join(names)}" if gpus else "GPU"
    else:
        mode = "CPU only: no CUDA GPU visible to this interpreter, so the GPU parts are skipped (reasons below)"
    return [f"- host: {socket.gethostname()}; interpreter: `{sys.executable}` (Python {platform.python_version()})",
            f"- torch {host.get('torch', '?')}, CUDA {host.get('cuda') or 'none'}, NCCL "
            f"{'.'.join(map(str, host['nccl'])) if host.get('nccl') else 'none'}",
            f"- mode: {mode}"]


def render(done: list[Done], pending: list[Stage], out: Path, device: str, elapsed_s: float) -> str:
    failed = [d.stage.key for d in done if d.status == FAILED]
    counts = {s: sum(d.status == s for d in done) for s in (PASSED, FAILED, SKIPPED)}
    verdict = "FAILED: " + ", ".join(failed) if failed else ("PASSED" if not pending else "running")
    waiting = f", {len(pending)} not run yet" if pending else ""
    lines = [f"# recover gpu-check: {verdict}", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {duration(elapsed_s)}; {counts[PASSED]} passed, "
             f"{counts[FAILED]} failed, {counts[SKIPPED]} skipped{waiting}",
             *environment(device, load_json(out / "check.json")), ""]
    rows = [[str(i), d.stage.title, d.status, duration(d.seconds) if d.status != SKIPPED else "-",
             d.stage.skip or f"{d.stage.key}.log"] for i, d in enumerate(done, 1)]
    rows += [[str(len(done) + i), s.title, "not run yet", "-", ""] for i, s in enumerate(pending, 1)]
    lines += [*md_table(["#", "stage", "status", "time", "log / reason"], rows), ""]
    for i, d in enumerate(done, 1):
        lines += stage_section(i, d, out)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running it

def run(device: str, out: Path, quick: bool = False) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    out.mkdir(parents=True, exist_ok=True)
    report = out / "REPORT.md"
    stages = plan(device, out, quick=quick)
    done: list[Done] = []
    t0 = time.monotonic()
    console = Console(stderr=True)
    console.print(f"gpu-check ({'GPU' if device == 'cuda' else 'CPU only: GPU parts skipped'}): "
                  f"{len(stages)} stages into {out}", highlight=False, soft_wrap=True)
    columns = SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()
    with Progress(*columns, console=console, transient=True) as bar:
        for i, stage in enumerate(stages, 1):
            task = bar.add_task(f"[{i}/{len(stages)}] {stage.title}", total=1)
            d = run_stage(stage, out)
            done.append(d)
            bar.update(task, completed=1)
            bar.console.print(f"[{i}/{len(stages)}] {stage.title}: {d.status}"
                              + (f" ({duration(d.seconds)})" if d.status != SKIPPED else f" ({stage.skip})"),
                              highlight=False, markup=False, soft_wrap=True)
            bar.remove_task(task)
            report.write_text(render(done, stages[i:], out, device, time.monotonic() - t0), encoding="utf-8")
    failed = [d.stage.title for d in done if d.status == FAILED]
    console.print(f"gpu-check {'FAILED: ' + '; '.join(failed) if failed else 'passed'} in "
                  f"{duration(time.monotonic() - t0)}; report: {report}", highlight=False, markup=False, soft_wrap=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="make gpu-check: see this module's docstring")
    p.add_argument("--device", choices=("cuda", "cpu"), required=True,
                   help="cuda: the interpreter's torch sees a GPU; cpu: run what a CPU can and skip the rest")
    p.add_argument("--out", default="runs/gpu-check", help="directory of the report and logs (default runs/gpu-check)")
    p.add_argument("--quick", action="store_true",
                   help="fit a short GPU lease (~8 min): 125m only, eager, no compiled benchmark")
    args = p.parse_args(argv)
    missing = missing_modules()
    if missing:
        print(f"gpu-check: {sys.executable} lacks {', '.join(missing)}: install them into it (pip install "
              f"{' '.join(missing)}) or run make gpu-check PYTHON=an interpreter that has them", file=sys.stderr)
        return 2
    return run(args.device, Path(args.out), quick=args.quick)


def missing_modules(names: tuple[str, ...] = NEEDED) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


if __name__ == "__main__":
    sys.exit(main())
