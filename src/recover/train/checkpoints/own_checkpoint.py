"""Checkpoints of a user's model (:meth:`recover.api.Job.save`, ``Job(resume=...)``), on the built-in
trainer's disk conventions and helpers (:func:`~recover.train.checkpoints.checkpoint.save_state`: ``.partial``
directory, manifest with SHA-256, fsynced ``COMMITTED`` marker, rename into place, keep-N).

Layout: ``RUN/checkpoints/step_NNNNNN/`` (NNNNNN: committed steps) holds
- the DCP files (``torch.distributed.checkpoint``) of the state dict ``{"model": ..., "optim": ...,
  "rng": {"cpu": ...}, "extra": {"0": ..., "1": ...}}``: ``model`` and ``optim`` as
  ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` gives them (keys: the
  parameters' and buffers' names), ``extra`` the tensors of the extra state in
  :func:`~recover.train.checkpoints.extra.encode`'s order (absent without extra state);
- ``meta.json``: ``step``, ``format`` (``"own"``), ``params`` (name -> shape of every entry of the model's
  ``state_dict()``), ``data_cursor.step``, ``total_tokens``, ``seed``, ``microbatches`` and ``extra``
  (``parts``, the JSON ``skeleton`` of their state dicts, the tensors' ``shapes``; or null);
- ``manifest.json`` and ``COMMITTED``.
Without recover: build the same model and optimizer, ``state = {"model": model_sd, "optim": optim_sd}``
from ``get_state_dict``, ``dcp.load(state, checkpoint_id=path)``, then ``set_state_dict``.

Contract:
- :func:`save` writes from this process alone (no process group, no collective): the caller decides
  who writes (in a launched job, the lowest live replica: :meth:`recover.api.Job.save`).
- :func:`resume` loads the newest intact checkpoint into the replica's model, optimizer and extra state
  and returns the counters it holds; a damaged one is named in one line and the next older one is
  tried; one of another model (other parameter names or shapes, other extra state, or a built-in
  model's) is refused in one line (:class:`~recover.errors.IncompatibleCheckpoint`) before anything is
  read; with no complete checkpoint it says so in one line and returns None (start fresh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Protocol

import torch

from recover.errors import IncompatibleCheckpoint
from recover.recovery.protocol import Progress
from recover.train.checkpoints.checkpoint import load_state, save_state
from recover.train.checkpoints.extra import Stateful, decode, encode, load_into, state_of
from recover.train.checkpoints.integrity import OWN_FORMAT, load_newest, remove_leftovers


class OwnState(Protocol):
    """What these checkpoints hold of a user's replica (:class:`~recover.train.replicas.own.OwnReplica` is one): its
    model, optimizer and extra state by part (:func:`~recover.train.checkpoints.extra.parts`). Declared here, so that
    checkpoints do not import the replica they save."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def extra(self) -> dict[str, Stateful]: ...


def checkpoints_of(run_dir: str | os.PathLike[str]) -> Path:
    """Where a run directory keeps its checkpoints (as the built-in trainer's)."""
    return Path(run_dir) / "checkpoints"


def save(root: Path, replica: OwnState, progress: Progress, *, seed: int, microbatches: int, keep: int) -> Path:
    """Checkpoints ``replica`` after ``progress.step`` committed steps under ``root``; returns its directory.
    Complete checkpoints older than the newest ``keep`` are deleted (0: none)."""
    skeleton, tensors = encode(state_of(replica.extra))
    meta = {"format": OWN_FORMAT, "params": shapes(replica.model), "data_cursor": {"step": progress.data_step},
            "total_tokens": progress.tokens, "seed": seed, "microbatches": microbatches,
            "extra": {"parts": sorted(replica.extra), "skeleton": skeleton, "shapes": [list(t.shape) for t in tensors]}
            if replica.extra else None}
    return save_state(root, progress.step, replica.model, replica.optimizer, meta, keep=keep,
                      extra={str(i): t for i, t in enumerate(tensors)})


def resume(root: Path, replica: OwnState, *, clean: bool) -> Progress | None:
    """Loads the newest intact checkpoint under ``root`` into ``replica``; returns its counters, or None
    (one line on stderr) when there is none. ``clean``: first delete what interrupted saves left (only
    when no save can be in flight).

    Raises:
        IncompatibleCheckpoint: it is of another model (nothing loaded).
        CheckpointError: every checkpoint there is damaged.
    """
    if clean:
        remove_leftovers(root)
    found = load_newest(root, lambda path: _load(path, replica), "resume", "pass resume=None to start afresh")
    if found is None:
        print(f"recover: resume: no complete checkpoint under {root}; starting from step 0", file=sys.stderr,
              flush=True)
        return None
    path, meta = found
    print(f"recover: resumed from {path} (step {meta['step']})", file=sys.stderr, flush=True)
    return Progress(int(meta["step"]), int(meta["data_cursor"]["step"]), int(meta["total_tokens"]))


def _load(path: Path, replica: OwnState) -> dict[str, Any]:
    """``path`` into ``replica`` (its model, optimizer, RNG, extra state); returns ``meta.json``."""
    _, tensors = encode(state_of(replica.extra))
    meta = load_state(path, replica.model, replica.optimizer, lambda meta, p: check_fits(meta, replica, p),
                      extra={str(i): t for i, t in enumerate(tensors)})
    if replica.extra:
        load_into(replica.extra, decode(meta["extra"]["skeleton"], tensors), str(path))
    return meta


def shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Name -> shape of every entry of ``model.state_dict()`` (parameters and persistent buffers)."""
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def check_fits(meta: dict[str, Any], replica: OwnState, path: Path) -> None:
    """Raises IncompatibleCheckpoint (one line) unless checkpoint ``path`` is of ``replica``'s model and extra state."""
    if meta.get("format") != OWN_FORMAT:
        raise IncompatibleCheckpoint(f"checkpoint {path} is the built-in trainer's (recover train), not one of "
                                     "job.save(); give a run directory of your own model's")
    saved, current = meta.get("params", {}), shapes(replica.model)
    diffs = [f"{n}: checkpoint {saved.get(n)}, this model {current.get(n)}" for n in sorted({*saved, *current})
             if saved.get(n) != current.get(n)]
    if diffs:
        more = f"; and {len(diffs) - 1} more" if len(diffs) > 1 else ""
        raise IncompatibleCheckpoint(f"checkpoint {path} was written for another model ({diffs[0]}{more}); resume "
                                     "with the same model, or use another run directory")
    _check_extra(meta.get("extra"), replica, path)


def _check_extra(saved: dict[str, Any] | None, replica: OwnState, path: Path) -> None:
    parts, saved_parts = sorted(replica.extra), (saved or {}).get("parts", [])
    if saved_parts != parts:
        raise IncompatibleCheckpoint(f"checkpoint {path} holds {_named(saved_parts)}, this Job has {_named(parts)}; "
                                     "pass the same extra= as the job that saved it")
    if saved:
        _, tensors = encode(state_of(replica.extra))
        if saved["shapes"] != [list(t.shape) for t in tensors]:
            raise IncompatibleCheckpoint(f"checkpoint {path}: the extra state's tensors have other shapes than "
                                         "this Job's; pass the same extra= as the job that saved it")


def _named(parts: list[str]) -> str:
    if not parts:
        return "no extra state"
    return "one extra object" if parts == [""] else f"extra state {parts}"
