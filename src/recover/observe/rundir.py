"""Run directories: whether ``--out`` already holds a run, and clearing one on request.

Contract: :func:`check_out` (no side effect) refuses, with one line naming what is there and the two
ways on, an ``--out`` that holds another run's records or checkpoints unless the command continues
it (``--resume``) or replaces it (``--overwrite``), and one that cannot be written (a file in its
path, a read-only file system, no permission), before anything starts. :func:`clear_run` deletes only
what a run writes there (records, checkpoints, logs, plots, TensorBoard files, offline W&B runs), never
anything else in the directory.
:func:`refused` is the one line naming a write the storage refused (path, free space, cause).
:func:`write_private` writes a secret (the coordinator's token) readable by its owner alone from the
moment it exists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from recover.errors import ConfigError

RECORDS = ("metrics.jsonl", "events.jsonl", "summary.json", "config.json", "token")
DIRECTORIES = ("checkpoints", "replicas", "logs", "tensorboard", "wandb")
CUT_OFF_DIR = "cut_off"
"""``checkpoints/cut_off/replica_R/``: the committed state kept by the lowest member of a generation whose
replica was cut off from the coordinator (every replica may have been); see :func:`recover.launch.launcher.rescue`."""


def run_contents(out: Path) -> list[str]:
    """What of a run ``out`` holds (empty: nothing, a fresh directory)."""
    if not out.is_dir():
        return []
    found = [name for name in RECORDS if (out / name).is_file()]
    found += [f"{name}/" for name in DIRECTORIES if (out / name).is_dir() and any((out / name).iterdir())]
    return found


def check_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Raises ConfigError when ``out`` holds a run and neither ``resume`` nor ``overwrite`` is given."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite deletes it: give one of them")
    found = run_contents(out)
    if found and not resume and not overwrite:
        raise ConfigError(f"--out {out} holds another run ({', '.join(found[:4])}); continue it with --resume, "
                          "replace it with --overwrite, or choose a new --out")
    check_writable(out)


def check_writable(out: Path) -> None:
    """Raises ConfigError when the run directory ``out`` could not be created or written."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out} cannot be a run directory: {existing} is a file; choose another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out} is not writable ({existing}: read-only or no permission); choose a "
                          "directory you can write, or fix its permissions")


def refused(path: Path, exc: OSError) -> str:
    """``could not write PATH (N MiB free; OSError: [Errno 28] No space left on device)``: one line."""
    try:
        free = f"{shutil.disk_usage(_existing(path)).free / 2**20:,.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"could not write {path} ({free}; {type(exc).__name__}: {exc})"


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_private(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` with mode 0600 from its creation (never readable by others, not even
    for a moment), replacing what was there."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def clear_run(out: Path) -> None:
    """Deletes what a run wrote under ``out`` (see the module docstring)."""
    for name in RECORDS:
        (out / name).unlink(missing_ok=True)
    for name in DIRECTORIES:
        shutil.rmtree(out / name, ignore_errors=True)
    for plot in out.glob("*.png"):
        plot.unlink()
