"""A replica's step metrics sent where clusters look: TensorBoard and Weights & Biases (``observe.*``).

Contract: :meth:`StepSinks.open` (rank 0 of a replica, or the writer of ``recover train``) opens what
``observe`` asks for; :meth:`StepSinks.step` takes each committed step's ``metrics.jsonl`` record and
logs the same scalars (:data:`SCALARS`, by their dashboard names) to each, at the record's step;
:meth:`StepSinks.close` ends them. Layout: ``RUN_DIR/tensorboard/NAME/`` (NAME ``replica_R``, or ``train``)
with one event file per process: each replica writes only its own directory, so replicas on other
machines writing to shared storage, a restarted replica, and no launcher at all need no merging; the
coordinator writes ``RUN_DIR/tensorboard/job/`` (:mod:`recover.observe.jobmetrics`). Pointing
TensorBoard at ``RUN_DIR/tensorboard`` shows every replica and the job as runs side by side.

W&B: one run per replica process (named NAME, ``job_type`` ``replica``), grouped by the run directory's
name (or ``WANDB_RUN_GROUP``): W&B's model for distributed training, a run per process, and a replica is
a process on its own machine that can die or rejoin alone. W&B leaves the process's stdout and stderr
alone (``console="off"``: they stay the replica's log). ``wandb`` is an optional extra imported only
here; :func:`check_extras` refuses a config that asks for it when it is absent, in one line, before
anything starts. A sink that fails to start or to log costs one line on stderr and is dropped: the
training never stops for its dashboards.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from recover.config import Config, ObserveConfig
from recover.errors import ConfigError
from recover.observe.tensorboard import EventFileWriter

SCALARS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "time_s": "perf/step_s", "computed": "perf/microbatches_computed",
           "recovery_ms": "perf/recovery_ms", "live_replicas": "job/live_replicas", "generation": "job/generation"}
"""``metrics.jsonl`` field -> the scalar's name in TensorBoard and W&B."""

WANDB_EXTRA = "pip install 'recover-llm[wandb]'"


def check_extras(observe: ObserveConfig) -> None:
    """Raises ConfigError, naming the install command, when ``observe.wandb`` is on and wandb is absent."""
    if observe.wandb != "off" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"observe.wandb = {observe.wandb!r} needs the wandb package: {WANDB_EXTRA} "
                          "(or --observe.wandb off)")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The dashboard scalars of a step record (a script's own ``job.log`` metrics as ``user/NAME``)."""
    values = {name: float(record[key]) for key, name in SCALARS.items()
              if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)}
    return values | {f"user/{name}": float(v) for name, v in (record.get("user") or {}).items()}  # job.log(...)


class StepSinks:
    """The dashboards one writer of step records logs to (see the module docstring)."""

    def __init__(self, board: EventFileWriter | None, run: Any) -> None:
        self.board, self.run = board, run

    @classmethod
    def open(cls, cfg: Config, run_dir: str | os.PathLike[str], name: str) -> StepSinks | None:
        """The sinks ``cfg.observe`` asks for, as ``name`` (None: none asked for)."""
        observe, run_dir = cfg.observe, Path(run_dir)
        if not observe.tensorboard and observe.wandb == "off":
            return None
        board = EventFileWriter(run_dir / "tensorboard" / name) if observe.tensorboard else None
        return cls(board, _wandb_run(cfg, run_dir, name) if observe.wandb != "off" else None)

    def step(self, record: dict[str, Any]) -> None:
        """Logs a committed step's record."""
        values = scalars(record)
        if self.board is not None:
            self.board.scalars(int(record["step"]), values)
        if self.run is not None:
            try:
                self.run.log(values, step=int(record["step"]))
            except Exception as exc:  # noqa: BLE001 - a dashboard never stops the training
                self.run = _dropped("log to W&B", exc)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as exc:  # noqa: BLE001
                _dropped("finish the W&B run", exc)
            self.run = None


def _wandb_run(cfg: Config, run_dir: Path, name: str) -> Any:
    """A W&B run for ``name`` (None, after one line, when it cannot start)."""
    try:
        import wandb

        return wandb.init(project=cfg.observe.wandb_project, mode=cfg.observe.wandb, name=name,
                          group=os.environ.get("WANDB_RUN_GROUP") or run_dir.resolve().name, job_type="replica",
                          config=cfg.to_dict(), dir=os.environ.get("WANDB_DIR") or str(run_dir),
                          settings=wandb.Settings(console="off"))  # the process's streams stay its own
    except Exception as exc:  # noqa: BLE001 - no login, no network, a broken install: one line
        return _dropped("start a W&B run", exc)


def _dropped(what: str, exc: BaseException) -> None:
    print(f"recover: cannot {what} ({type(exc).__name__}: {exc}); training goes on without it",
          file=sys.stderr, flush=True)
    return None
