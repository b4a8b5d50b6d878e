"""Checkpoints on disk, without torch: which are complete, what interrupted saves left, and
manifests, what a complete checkpoint holds, checked before any of it is loaded.

Contract:
- A complete checkpoint is a directory ``step_NNNNNN`` holding the ``COMMITTED`` marker
  (:func:`list_checkpoints`); ``.partial`` and ``.replaced`` directories are what interrupted saves
  left (:func:`remove_leftovers` deletes them; only when no save can be in flight).
- :func:`write_manifest` is the last step of a save before its ``COMMITTED`` marker: it records the
  size and SHA-256 of every file of the checkpoint directory (DCP shards, ``.metadata``,
  ``meta.json``; every rank's files, read by the one writer) in ``manifest.json``, fsynced. SHA-256
  because any changed bit changes it, CPUs hash it at 1-2 GB/s per core (SHA extensions), and
  ``sha256sum`` checks it by hand; files are hashed on a few threads (hashlib releases the GIL).
- :func:`verify` raises :class:`~recover.errors.CheckpointError` naming the checkpoint and the first
  bad file (missing, truncated or grown, different content, or a file the manifest does not list)
  unless every file matches; a checkpoint that has no manifest (written before manifests existed)
  passes with ``verified = False`` so old runs still resume.
- :func:`load_newest` runs a loader on the newest intact checkpoint: a damaged one is named in one line
  and the next older one tried; one of another model stops the search at once.
- :func:`begin_save` and :func:`commit_save` are the protocol every save follows (whichever process writes
  the state): the state is written into ``step_NNNNNN.partial/``, then ``meta.json``, the manifest and the
  fsynced marker, then the directory is renamed into place (an older save of the same step moved aside
  first, never deleted in place) and checkpoints beyond ``keep`` are deleted.
- :func:`check_compatible` tells a checkpoint of another model from its ``meta.json`` alone.
- Neither reads the state into memory beyond one chunk per thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from recover.errors import CheckpointError, IncompatibleCheckpoint
from recover.model.spec import ModelConfig

MARKER = "COMMITTED"
OWN_FORMAT = "own"
"""``meta.json``'s ``format`` in a checkpoint of a user's model (:mod:`recover.train.checkpoints.own_checkpoint`)."""
MANIFEST = "manifest.json"
ALGORITHM = "sha256"
_CHUNK = 8 << 20
_SKIP = frozenset({MANIFEST, MARKER})
_NAME = re.compile(r"^step_(\d{6,})$")


def checkpoint_path(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def load_newest(root: Path, load: Callable[[Path], dict[str, Any]], who: str,
                fresh: str) -> tuple[Path, dict[str, Any]] | None:
    """``load(path)`` of the newest intact complete checkpoint under ``root``: a damaged one (a file changed,
    truncated or missing since the save, or unreadable) is named in one line on stderr and the next older
    one is tried. Returns its path and ``meta.json``; None when there is no complete checkpoint.

    Raises:
        IncompatibleCheckpoint: at once (an older one would not fit either).
        CheckpointError: every one is damaged (the line names ``who`` asked and how to start ``fresh``).
    """
    damaged: list[str] = []
    found = list_checkpoints(root)
    for _, path in reversed(found):
        try:
            return path, load(path)
        except IncompatibleCheckpoint:
            raise
        except CheckpointError as exc:
            damaged.append(path.name)
            print(f"recover: {exc}; trying the previous checkpoint", file=sys.stderr, flush=True)
    if damaged:
        raise CheckpointError(f"{who}: every checkpoint under {root} is damaged ({', '.join(damaged)}); "
                              f"restore one from a copy or {fresh}")
    return None


def check_compatible(meta: dict[str, Any], model_cfg: ModelConfig, path: Path) -> None:
    """Raises :class:`~recover.errors.IncompatibleCheckpoint` unless the checkpoint whose ``meta.json`` is
    ``meta`` (at ``path``) was written for ``model_cfg``'s model, naming every field that differs. Pure: the
    launcher asks it of the newest checkpoint before any process starts, every loader before it reads."""
    saved = {"arch": "llama", **meta.get("model", {})}  # written before model.arch existed: Llama, the only one
    current = dataclasses.asdict(model_cfg)
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in current.items()
             if saved.get(k) != v]
    if diffs:
        raise IncompatibleCheckpoint(f"checkpoint {path} was written for another model ({'; '.join(diffs)}); "
                                     "resume with the same model config, or use a new --out directory")


def remove_leftovers(root: str | os.PathLike[str]) -> list[Path]:
    """Deletes the ``.partial`` and ``.replaced`` directories interrupted saves left under ``root``;
    returns them. Only when no save can be in flight."""
    root = Path(root)
    gone = sorted(p for p in root.glob("step_*") if p.is_dir() and p.suffix in (".partial", ".replaced")) \
        if root.is_dir() else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def begin_save(root: str | os.PathLike[str], step: int) -> tuple[Path, Path]:
    """(final, partial) directories of a save of ``step``; a stale partial one is cleared."""
    final = checkpoint_path(root, step)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return final, partial


def commit_save(partial: Path, final: Path, step: int, meta: dict[str, Any], keep: int = 0,
                files: dict[str, bytes] | None = None) -> None:
    """Makes a fully written ``partial`` directory the checkpoint of ``step`` (the last act of a save);
    ``meta`` becomes its ``meta.json`` (with ``step``); ``files`` (name -> bytes, e.g. the run's
    ``tokenizer.json``) are stored with it, under the manifest."""
    for name, data in (files or {}).items():
        with open(partial / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    record = {"step": step, **meta}
    _write_synced(partial / "meta.json", json.dumps(record, indent=1))
    t0 = time.perf_counter()
    manifest = write_manifest(partial)
    _write_synced(partial / MARKER, json.dumps({"step": step, "manifest_s": round(time.perf_counter() - t0, 4),
                                                "bytes": sum(int(e["bytes"]) for e in manifest.values())}))
    aside = final.with_name(final.name + ".replaced")
    if final.exists():  # an older save of the same step: move it aside (atomic), delete it only afterwards
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    if keep > 0:
        for _, old in list_checkpoints(final.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()
                  and str(p.relative_to(directory)) not in _SKIP)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_all(directory: Path, names: list[str]) -> dict[str, str]:
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: _digest(directory / n), names), strict=True))


def write_manifest(directory: str | os.PathLike[str]) -> dict[str, dict[str, int | str]]:
    """Hashes every file of ``directory`` into its ``manifest.json`` (fsynced); returns the entries."""
    directory = Path(directory)
    names = _files(directory)
    hashes = _hash_all(directory, names)
    files = {n: {"bytes": (directory / n).stat().st_size, ALGORITHM: hashes[n]} for n in names}
    with open(directory / MANIFEST, "w", encoding="utf-8") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return files


def verify(directory: str | os.PathLike[str]) -> bool:
    """Checks every file of the checkpoint ``directory`` against its manifest.

    Returns:
        True when verified; False when the checkpoint has no manifest (an older format: unchecked).
    Raises:
        CheckpointError: one line naming the checkpoint and the first bad file.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        expected = {str(n): (int(e["bytes"]), str(e[ALGORITHM])) for n, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {directory} is damaged: its {MANIFEST} is unreadable ({exc})") from None
    present = set(_files(directory))
    for name in sorted(expected):
        size = expected[name][0]
        if name not in present:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} is missing")
        actual = (directory / name).stat().st_size
        if actual != size:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} has {actual:,} bytes, "
                                  f"{size:,} were written")
    extra = sorted(present - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {directory} is damaged: {extra[0]} is not part of it")
    hashes = _hash_all(directory, sorted(expected))
    for name in sorted(expected):
        if hashes[name] != expected[name][1]:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} does not match its "
                                  f"{ALGORITHM} (bytes changed after the save)")
    return True


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A complete checkpoint's ``meta.json``. Raises CheckpointError (no marker, unreadable)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was "
                              "interrupted while saving; resume from an older one or start afresh")
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}/meta.json is unreadable ({exc}); the checkpoint is damaged") from None
