"""Self-describing checkpoints: each one carries its run config and its tokenizer.

Sampling, export and ``--init-from`` need nothing but a checkpoint directory. Besides the step and
the data cursor, a checkpoint's ``meta.json`` holds the model config (``model``), the whole run
config (``config``) and a record of the tokenizer (``tokenizer``):

- recover's byte tokenizer: ``{"spec": "byte", "vocab_size": 257, "eot_id": 256}`` (its exact
  reference: :func:`recover.data.tokenizer.load_tokenizer` recreates it from the spec);
- a HuggingFace tokenizer: a copy of its ``tokenizer.json`` in the checkpoint directory, recorded
  as ``{"file": "tokenizer.json", "source": original path, "sha256", "vocab_size", "eot_id"}``;
- data whose tokenizer is unknown (no ``meta.json`` in the data directory): ``null``.

Contract:
- :func:`describe_run` is computed once per run by the checkpoint writer (it reads the data
  directory's ``meta.json``); :func:`recover.train.checkpoints.checkpoint.save_checkpoint` writes its files into
  the checkpoint before ``meta.json``, the manifest and the ``COMMITTED`` marker, so the manifest
  covers them and a checkpoint is never visible without them.
- :func:`resolve_checkpoint` turns a RUN_DIR or a checkpoint directory into one intact checkpoint
  (a run directory: its newest one that verifies; a damaged one is named on stderr and the next
  older one tried).
- :func:`read_description` returns what a checkpoint says about itself; a checkpoint written before
  these records existed falls back to its run directory's ``config.json`` (``RUN/checkpoints/step_N``
  -> ``RUN/config.json``) and that config's data directory; :meth:`Description.tokenizer` raises one
  line naming what is missing and the fix (``--tokenizer``) when nothing says which tokenizer it was.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.config import Config, ModelConfig
from recover.data.tokenizer import BYTE_SPEC, ByteTokenizer, HFTokenizer, load_tokenizer
from recover.errors import CheckpointError, ConfigError, RecoverError
from recover.train.checkpoints.integrity import MARKER, OWN_FORMAT, list_checkpoints, read_meta, verify

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class RunDescription:
    """What every checkpoint of a run carries: ``meta`` keys for ``meta.json`` and files to store."""

    meta: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)


def tokenizer_record(data_dir: Path) -> tuple[dict[str, Any] | None, dict[str, bytes]]:
    """The tokenizer record of the data in ``data_dir`` (from its ``meta.json``) and the files to store."""
    try:
        meta = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, {}
    spec = meta.get("tokenizer")
    if not isinstance(spec, str):
        return None, {}
    record: dict[str, Any] = {"vocab_size": meta.get("vocab_size"), "eot_id": meta.get("eot_id")}
    if spec == BYTE_SPEC:
        return {"spec": BYTE_SPEC, **record}, {}
    source = Path(spec)
    source = source / TOKENIZER_FILE if source.is_dir() else source
    record.update(source=str(source), sha256=meta.get("tokenizer_sha256"))
    try:
        data = source.read_bytes()
    except OSError:
        return record, {}  # gone since `recover prepare`: its path and hash are all we can record
    return {**record, "file": TOKENIZER_FILE, "sha256": hashlib.sha256(data).hexdigest()}, {TOKENIZER_FILE: data}


def describe_run(cfg: Config) -> RunDescription:
    """The run config and the tokenizer of ``cfg``'s data, for every checkpoint of the run."""
    from recover.data.layout import resolve_data_dir

    try:
        data_dir = resolve_data_dir(cfg.data)
    except RecoverError:
        data_dir = Path(cfg.data.path)
    record, files = tokenizer_record(data_dir)
    return RunDescription({"config": cfg.to_dict(), "tokenizer": record}, files)


# ---- reading ---------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself, or a run directory's newest intact checkpoint.

    Raises:
        CheckpointError: not a checkpoint or run directory, none complete, or every one damaged.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give a run directory or a checkpoint directory "
                              "(RUN/checkpoints/step_NNNNNN)")
    if (path / MARKER).is_file():
        verify(path)
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = list_checkpoints(root)
    if not found:
        if path.name.startswith("step_") and path.is_dir():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker): its save was "
                                  "interrupted; use an older checkpoint or the run directory")
        raise CheckpointError(f"{path}: no complete checkpoint there; give a run directory with checkpoints/ of the "
                              "built-in trainer (train with --training.checkpoint_every K) or a checkpoint directory "
                              "step_NNNNNN (a script's own model, saved by job.save(), is not taken: load it with "
                              "torch.distributed.checkpoint)")
    damaged = []
    for _, ckpt in reversed(found):
        try:
            verify(ckpt)
            return ckpt
        except CheckpointError as exc:
            damaged.append(ckpt.name)
            print(f"recover: {exc}; trying the previous checkpoint", file=sys.stderr, flush=True)
    raise CheckpointError(f"every checkpoint under {root} is damaged ({', '.join(damaged)})")


@dataclass(frozen=True)
class Description:
    """What a checkpoint says about itself (with the fallbacks of an older one)."""

    checkpoint: Path
    step: int
    model: ModelConfig
    config: dict[str, Any] | None
    """The whole run config, or None (an older checkpoint whose run directory has no config.json)."""
    tokenizer_record: dict[str, Any] | None

    def tokenizer(self, override: str | None = None) -> ByteTokenizer | HFTokenizer:
        """The run's tokenizer (or ``override``, a spec as ``recover prepare --tokenizer`` takes).

        Raises:
            RecoverError: the checkpoint names no tokenizer, or its file is missing.
        """
        if override:
            return load_tokenizer(override)
        rec = self.tokenizer_record
        if rec is None:
            raise CheckpointError(f"{self.checkpoint} does not say which tokenizer its run used (written before "
                                  "checkpoints recorded it, or trained on data without meta.json); pass "
                                  "--tokenizer byte or --tokenizer path/to/tokenizer.json")
        if rec.get("spec") == BYTE_SPEC:
            return ByteTokenizer()
        local = self.checkpoint / str(rec.get("file", TOKENIZER_FILE))
        if local.is_file():
            return HFTokenizer(local)
        source = Path(str(rec.get("source", "")))
        if source.is_file() and (not rec.get("sha256")
                                 or hashlib.sha256(source.read_bytes()).hexdigest() == rec["sha256"]):
            return HFTokenizer(source)
        raise CheckpointError(f"{self.checkpoint}: the run's tokenizer {rec.get('source')!r} is neither in the "
                              "checkpoint nor unchanged at its path; pass --tokenizer path/to/tokenizer.json")


def _run_config(checkpoint: Path) -> dict[str, Any] | None:
    """``RUN/config.json`` of ``RUN/checkpoints/step_N``, if there is one."""
    path = checkpoint.parent.parent / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_description(checkpoint: Path) -> Description:
    """What ``checkpoint`` (complete, see :func:`resolve_checkpoint`) records about its run.

    Raises:
        CheckpointError: unreadable ``meta.json`` or model config, or a checkpoint of a user's model.
    """
    meta = read_meta(checkpoint)
    if meta.get("format") == OWN_FORMAT:
        raise CheckpointError(f"{checkpoint} holds a model of your own (job.save): recover export, sample and "
                              "--training.init_from take the built-in models only; load it with "
                              "torch.distributed.checkpoint (layout: recover.train.checkpoints.own_checkpoint)")
    config = meta.get("config") or _run_config(checkpoint)
    model = meta.get("model") or (config or {}).get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{checkpoint}/meta.json has no model config and its run directory no config.json; "
                              "the checkpoint cannot be used on its own")
    try:
        model_cfg = ModelConfig(**model)
    except (TypeError, ConfigError) as exc:
        raise CheckpointError(f"{checkpoint}/meta.json: model config not understood ({exc})") from None
    if "tokenizer" in meta:
        record = meta["tokenizer"]
    else:  # an older checkpoint: the data directory its run config names
        record = _data_tokenizer(config)
    return Description(checkpoint, int(meta.get("step", 0)), model_cfg, config, record)


def _data_tokenizer(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if not config:
        return None
    from recover.config import from_dict

    try:
        cfg = from_dict(config)
    except ConfigError:
        return None
    return describe_run(cfg).meta["tokenizer"]
