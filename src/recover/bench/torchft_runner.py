"""torchft's fault-tolerant DDP on recover's model, data and failure schedule (a benchmark baseline).

Two sides:

* :func:`run_torchft` (the orchestrator; needs no torchft) starts a torchft ``LighthouseServer``
  process and N replica processes (``python -m recover.bench.torchft_runner replica ...``) with an
  interpreter where ``torchft`` imports (``pip install 'recover-llm[bench]'``, or another venv via
  ``python=``), waits for them, kills every process it started by PID, and writes the run
  directory in ``recover launch``'s format: ``metrics.jsonl`` (one record per committed step),
  ``events.jsonl`` (``launch``, ``train_start``, ``kill``, ``step_dropped``, ``end``) and
  ``summary.json``, so the same readers, comparisons and plots apply.
* :func:`replica_main` (one replica process): torchft's own training loop, as in its
  ``train_ddp.py`` example: a ``Manager`` (quorum through the Lighthouse, reconfigurable gloo
  process group, live healing), ``torchft.DistributedDataParallel`` (gradients averaged over the
  quorum's participants by the Manager's fault-tolerant all-reduce) and ``should_commit`` before
  the optimizer step.

Semantics (torchft's, not recover's): replica R always computes its fixed share of the
failure-free assignment of the step's M microbatch ids (its local batch). A step in which a
participant fails is not committed (its data is consumed, no update), and later steps average over
the survivors only: they hold fewer than M microbatches. Samples, learning rate schedule, model
initialisation, optimizer and clipping are recover's, so a failure-free run follows the same
trajectory as ``recover launch`` up to float summation order.

Settings are those of torchft's example: gloo timeout 5 s, Manager timeout 10 s, Lighthouse
``min_replicas`` 1, ``join_timeout_ms`` 10000, ``quorum_tick_ms`` 100 (heartbeat timeout: torchft's
default); ``init_sync=False``, as torchft advises when every replica initialises its model from the
same seed (so step 0 is not spent healing replicas that are already identical). Replicas start
training only once all N have a Manager (a file barrier), so the first quorum holds all of them.

Emulated devices: with ``training.device_time_s`` T > 0 (a config override, as for ``recover
launch``) every microbatch takes at least T of wall time, as in recover's ``Replica``: the process
sleeps out the rest of T after the microbatch's backward, or, for the microbatch whose backward
all-reduces (the last), in DDP's reduction hook before the all-reduce, so the all-reduce is not
counted as device time. The arithmetic is unchanged.

Failures: ``--fail R@STEP:PHASE`` as in ``recover launch`` (STEP = committed step, 0-based): the
replica SIGKILLs itself before a microbatch's forward or backward, in DDP's reduction hook
(``reduce``), before ``should_commit`` (``commit``), after it (``optimizer``) or after the step (``idle``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

from recover.bench.common import child_env, kill_group, wait_for
from recover.names import Event, Phase
from recover.observe.events import EventLog, JsonlWriter, read_jsonl

PG_TIMEOUT_S = 5.0
MANAGER_TIMEOUT_S = 10.0
JOIN_TIMEOUT_MS = 10_000
QUORUM_TICK_MS = 100
MODULE = "recover.bench.torchft_runner"


def torchft_available(python: str | None = None) -> tuple[bool, str]:
    """Whether ``import torchft`` works under ``python`` (default: this interpreter), and why not."""
    cmd = [python or sys.executable, "-c", "import torchft, torch; print(torch.__version__)"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{cmd[0]}: {exc}"
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["import failed"])[-1]
        return False, f"{cmd[0]}: {last}"
    return True, f"torch {res.stdout.strip()}"


# ---------------------------------------------------------------- orchestrator side

def _replica_cmd(python: str, rid: int, lighthouse: str, config: str, replicas: int, steps: int, out: Path,
                 fails: Sequence[str], overrides: Sequence[str]) -> list[str]:
    cmd = [python, "-m", MODULE, "replica", "--replica", str(rid), "--lighthouse", lighthouse, "--config", config,
           "--replicas", str(replicas), "--steps", str(steps), "--out", str(out)]
    for spec in fails:
        if str(spec).split("@", 1)[0].strip() == str(rid):
            cmd += ["--fail", str(spec)]
    return cmd + list(overrides)


def run_torchft(out: Path, config: str, replicas: int, steps: int, fails: Sequence[str] = (),
                overrides: Sequence[str] = (), python: str | None = None, timeout_s: float = 1800.0) -> int:
    """Runs torchft DDP into run directory ``out``; returns 0 when every step was committed.

    Raises:
        RuntimeError: the Lighthouse did not start.
    """
    from recover.config import load_config
    from recover.data.prepare import prepared_data_dir
    from recover.launch.report import summarize

    python = python or sys.executable
    cfg = load_config(config, [*overrides, f"--parallel.replicas={replicas}", f"--training.steps={steps}"])
    prepared_data_dir(cfg.data, quiet=True)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "replicas", "ready"):
        (out / sub).mkdir(exist_ok=True)
    for stale in [out / "metrics.jsonl", out / "events.jsonl", out / "summary.json", out / "lighthouse.addr",
                  *(out / "replicas").glob("*.jsonl"), *(out / "ready").iterdir()]:
        stale.unlink(missing_ok=True)
    events = EventLog(out / "events.jsonl")
    t0 = time.time()
    events.event(Event.LAUNCH, replicas=replicas, steps=steps, failures=list(fails), system="torchft")
    env = child_env()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []

    def start(cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(out / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        procs.append(proc)
        return proc

    try:
        addr_file = out / "lighthouse.addr"
        lighthouse = start([python, "-m", MODULE, "lighthouse", "--addr-file", str(addr_file)], "lighthouse")
        wait_for(lambda: addr_file.is_file() or lighthouse.poll() is not None, 120, "the torchft Lighthouse start")
        if lighthouse.poll() is not None:
            raise RuntimeError(f"the torchft Lighthouse exited with {lighthouse.returncode}; see "
                               f"{out / 'logs' / 'lighthouse.log'}")
        addr = addr_file.read_text().strip()
        workers = [start(_replica_cmd(python, r, addr, config, replicas, steps, out, fails, overrides), f"replica_{r}")
                   for r in range(replicas)]
        deadline = time.monotonic() + timeout_s
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = {r: w.poll() for r, w in enumerate(workers)}
    finally:
        for proc in procs:
            kill_group(proc)
        for log in logs:
            log.close()
    wall = time.time() - t0
    committed = _merge_metrics(out, t0)
    events.event(Event.END, wall_s=round(wall, 3), exit_codes=codes)
    events.close()
    summarize(out, "torchft", wall)
    return 0 if committed >= steps else 1


def _merge_metrics(out: Path, t0: float) -> int:
    """Writes ``metrics.jsonl`` from the replicas' logs: per step the first record, val_loss from any."""
    records: dict[int, dict[str, Any]] = {}
    for path in sorted((out / "replicas").glob("replica_*.jsonl")):
        for rec in read_jsonl(path):
            prev = records.get(rec["step"])
            if prev is None:
                records[rec["step"]] = rec
            elif rec.get("val_loss") is not None and prev.get("val_loss") is None:
                prev["val_loss"] = rec["val_loss"]
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in sorted(records):
            rec = dict(records[step])
            rec["elapsed_s"] = round(rec.pop("t") - t0, 3)
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return len(records)


# ---------------------------------------------------------------- process side

def lighthouse_main(args: argparse.Namespace) -> int:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=args.min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
                              quorum_tick_ms=QUORUM_TICK_MS)
    tmp = Path(args.addr_file + ".tmp")
    tmp.write_text(server.address())
    tmp.replace(args.addr_file)
    while True:  # the orchestrator kills this process by PID when the replicas are done
        time.sleep(3600)


def _ddp_class(on_reduce: Callable[[], None]) -> type:
    """torchft's DDP with two changes to its reduction hook, nothing else.

    1. The fault injector gets its ``reduce`` point first.
    2. torchft 0.2.0's hook ends with ``assert fut._fut``: when the fault-tolerant all-reduce failed
       (a peer died: gloo "Connection reset by peer" or a timeout) or the Manager had already
       errored, there is no inner future (``AssertionError`` / ``AttributeError``, as in torchft
       issue #304) and the surviving replica crashes in ``backward()``. Here the hook returns the
       bucket as it is instead; the Manager has recorded the error, so ``should_commit()`` is
       False and the step is discarded, which is what torchft intends.
    """
    import torch
    from torchft import DistributedDataParallel

    class InjectedDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
            on_reduce()
            work = state.allreduce(bucket.buffer())
            work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if inner is not None:
                return inner
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return InjectedDDP


def replica_main(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed import ReduceOp, TCPStore
    from torchft import Manager, ProcessGroupGloo

    from recover.config import load_config
    from recover.data.layout import resolve_data_dir
    from recover.faults import Perturbation, parse_failure
    from recover.launch.processes import free_port
    from recover.model import lm_loss
    from recover.train.processes.trainer import build_replica
    from recover.train.replicas.dist import DistContext
    from recover.train.replicas.optim import lr_at, set_lr
    from recover.workload import assign

    out, rid, n = Path(args.out), args.replica, args.replicas
    cfg = load_config(args.config, [*args.overrides, f"--parallel.replicas={n}", f"--training.steps={args.steps}"])
    tc = cfg.training
    replica, eval_data = build_replica(cfg, DistContext(local_world_size=n), resolve_data_dir(cfg.data))
    model, optim = replica.model, replica.optimizer

    def evaluate() -> float:
        return replica.evaluate([eval_data.batch(i) for i in range(tc.eval_batches)])

    events = EventLog(out / "events.jsonl")
    log = JsonlWriter(out / "replicas" / f"replica_{rid}.jsonl")
    perturbation = Perturbation([parse_failure(f) for f in args.fail], rid, record=lambda spec, kind, fields: (
        spec.kills and events.event(kind, replica=rid, **fields)))  # --fail and --slow R@STEP:FACTOR
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)  # noqa: F841 - kept alive
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=PG_TIMEOUT_S)), min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optim.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        replica_id=f"replica_{rid}", timeout=timedelta(seconds=MANAGER_TIMEOUT_S), lighthouse_addr=args.lighthouse,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store_port,
        init_sync=False)  # every replica builds the same model from the same seed (torchft's advice)
    current = {"step": 0, "mb_t0": 0.0}

    def emulate_device() -> None:
        """With ``training.device_time_s``, sleeps until the current microbatch has taken that long (times
        a ``slow`` fault's factor, or the real compute times it, as recover's replicas do)."""
        elapsed = time.perf_counter() - current["mb_t0"]
        left = max(tc.device_time_s, elapsed) * perturbation.time_factor() - elapsed
        if left > 0:
            time.sleep(left)

    def on_reduce() -> None:
        perturbation.at_phase(current["step"], Phase.REDUCE)
        emulate_device()  # the device time ends before the all-reduce (a no-op once it has passed)

    ddp = _ddp_class(on_reduce)(manager, model)
    mine = assign(list(range(tc.global_microbatches)), range(n))[rid]
    (out / "ready" / str(rid)).touch()
    wait_for(lambda: len(list((out / "ready").iterdir())) >= n, 600, "every torchft replica start")
    events.event(Event.TRAIN_START, replica=rid)
    data_step = 0
    while manager.current_step() < tc.steps:
        step = current["step"] = manager.current_step()
        t0 = time.perf_counter()
        set_lr(optim, lr_at(step, tc))
        optim.zero_grad(set_to_none=True)
        manager.start_quorum()  # what torchft's OptimizerWrapper.zero_grad does
        loss_sum = 0.0
        for i, mb in enumerate(mine):
            current["mb_t0"] = time.perf_counter()
            inputs, targets = replica.data.microbatch(data_step, mb)
            perturbation.at_phase(step, Phase.FORWARD)
            with ddp.no_sync() if i + 1 < len(mine) else nullcontext():
                loss = lm_loss(ddp(inputs), targets)
                perturbation.at_phase(step, Phase.BACKWARD)
                (loss / len(mine)).backward()  # the last backward's hook averages over the participants
            emulate_device()
            loss_sum += float(loss)
        totals = torch.tensor([loss_sum, float(len(mine))], dtype=torch.float64)
        manager.allreduce(totals, reduce_op=ReduceOp.SUM).wait()  # loss and microbatch count, for the log
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
        perturbation.at_phase(step, Phase.COMMIT)
        committed = manager.should_commit()
        data_step += 1  # torchft consumes the batch whether or not the step commits
        if not committed:
            events.event(Event.STEP_DROPPED, replica=rid, step=step, participants=manager.num_participants())
            continue
        perturbation.at_phase(step, Phase.OPTIMIZER)
        optim.step()
        _record(log, cfg, replica.tokens_per_microbatch, evaluate, manager, step, totals, grad_norm,
                time.perf_counter() - t0, data_step)
        perturbation.at_phase(step, Phase.IDLE)
    log.close()
    events.event(Event.FINISHED, replica=rid, step=manager.current_step())
    events.close()
    manager.shutdown(wait=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown of torchft's background threads


def _record(log: JsonlWriter, cfg: Any, tokens_per_microbatch: int, evaluate: Any, manager: Any, step: int,
            totals: Any, grad_norm: float, dt: float, data_step: int) -> None:
    tc = cfg.training
    count = round(float(totals[1]))
    tokens = count * tokens_per_microbatch
    record: dict[str, Any] = {
        "step": step, "replica": manager.participating_rank(), "loss": float(totals[0]) / max(count, 1),
        "microbatches": count, "tokens": tokens, "data_step": data_step - 1, "time_s": round(dt, 6),
        "grad_norm": grad_norm, "live_replicas": manager.num_participants(),
        "generation": getattr(manager, "_quorum_id", 0), "tokens_per_s": tokens / dt,
    }
    last = step + 1 == tc.steps
    if manager.participating_rank() == 0 and ((tc.eval_every and (step + 1) % tc.eval_every == 0) or last):
        record["val_loss"] = evaluate()
    log.write(record)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="torchft processes of `recover bench`")
    sub = p.add_subparsers(dest="role", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--addr-file", required=True)
    lh.add_argument("--min-replicas", type=int, default=1)
    rep = sub.add_parser("replica")
    rep.add_argument("--replica", type=int, required=True)
    rep.add_argument("--replicas", type=int, required=True)
    rep.add_argument("--steps", type=int, required=True)
    rep.add_argument("--lighthouse", required=True)
    rep.add_argument("--config", required=True)
    rep.add_argument("--out", required=True)
    rep.add_argument("--fail", action="append", default=[])
    args, extra = p.parse_known_args(argv)
    args.overrides = extra
    return lighthouse_main(args) if args.role == "lighthouse" else replica_main(args)


if __name__ == "__main__":
    sys.exit(main())
