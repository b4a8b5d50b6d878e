"""Tokenise text files into train/val token shards plus a ``meta.json``.

Contract:
    * Inputs are text files or directories (walked recursively for text suffixes, hidden entries
      skipped). Files are processed in sorted order of their relative path, so the output is the
      same on every machine and for every order in which inputs were listed or created.
    * Each file is one document; every document is preceded by the tokenizer's end-of-text id
      (llm.c convention), so documents are always separated by EOT (a tokenizer without one, which
      meta.json records as ``eot_id: null``, gets its documents simply concatenated).
    * The split is BY FILE: a file goes to val when a stable hash (sha256) of its relative path falls
      below ``val_fraction``. It never depends on file order, on other files or on the machine.
      Val and train each get at least one file; a single input file is split by its tail instead.
    * ``max_bytes`` keeps a deterministic, well-spread subset: files in order of a second (salted)
      path hash until the budget is spent; the last one may be cut.
    * Output, llm.c format (:mod:`recover.data.writers`): ``out_dir/train_000000.bin ...`` and
      ``out_dir/val_000000.bin ...``, shards of ``shard_tokens`` tokens whose last one takes the split's
      remainder (no shard shorter than llm.c's loaders accept when they accept a full one); uint16
      (magic 20240520) when every id written is below 65,536, else uint32 (20240801) for every shard:
      chosen by the largest id written, never by the tokenizer's size.
    * Output, nanoGPT format: exactly what nanoGPT's ``train.py`` reads: ``out_dir/train.bin`` and
      ``out_dir/val.bin`` (raw uint16, no header, one file per split) and ``out_dir/meta.pkl``
      (``{"vocab_size": V}``; recover has no character-level tokenizer, so no ``stoi``/``itos``).
    * Either way ``out_dir/meta.json`` is written last and atomically. A re-run with the same inputs
      (names, sizes, mtimes) and options finds a matching ``meta.json`` with its shards in place and
      skips the work.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from recover.config import DataConfig
from recover.data.layout import META_PKL
from recover.data.shards import META_NAME, UINT16_LIMIT, read_shard
from recover.data.tokenizer import Tokenizer, load_tokenizer
from recover.data.writers import NanoGPTWriter, ShardWriter, one_flavour, write_meta_pkl
from recover.errors import ConfigError, DataError

META_VERSION = 1
SPLITS = ("train", "val")
BUILTIN_CORPORA = ("stdlib",)
TEXT_SUFFIXES = frozenset(
    ".txt .md .rst .tex .org .py .pyi .json .jsonl .csv .tsv .html .htm .xml .yaml .yml .toml .ini .cfg "
    ".c .h .cc .cpp .hpp .rs .go .java .js .ts .sh .sql .r .jl .lua .rb".split()
)
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
)
SHARD_NAME = re.compile(r"^(train|val)(_\d{6})?\.bin$")
DEFAULT_SHARD_TOKENS = 50_000_000
MAX_SHARD_TOKENS = (2**31 - 1) // 2  # llm.c's header counts tokens in an int32; the last shard may double


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of one source file: one document."""

    path: Path
    rel: str  # relative path, '/'-separated: the file's identity for split and order
    start: int
    stop: int
    mtime_ns: int

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read(self.stop - self.start)


def path_hash(rel: str, salt: str = "split") -> float:
    """A stable number in [0, 1) for a relative path (same on every machine and run)."""
    digest = hashlib.sha256(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ---------------------------------------------------------------- collecting files


def _piece(path: Path, rel: str) -> Piece:
    st = path.stat()
    return Piece(path, rel, 0, st.st_size, st.st_mtime_ns)


def _walk(
    root: Path, keep_file: Callable[[str], bool], keep_dir: Callable[[str], bool], skip: Path | None
) -> Iterable[Piece]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and keep_dir(d) and (here / d).resolve() != skip
        )
        for name in sorted(filenames):
            if not name.startswith(".") and keep_file(name):
                yield _piece(here / name, (here / name).relative_to(root).as_posix())


def collect_files(
    inputs: Iterable[str | Path],
    keep_file: Callable[[str], bool] | None = None,
    keep_dir: Callable[[str], bool] | None = None,
    skip_dir: Path | None = None,
) -> list[Piece]:
    """Non-empty text files under ``inputs``, deduplicated, sorted by relative path.

    A file given directly is always taken (its relative path is its name); a directory contributes
    files accepted by ``keep_file`` (default: text suffixes) under directories accepted by
    ``keep_dir``, relative to that directory. ``skip_dir`` (the output directory) is never entered.
    """
    keep_file = keep_file or (lambda name: Path(name).suffix.lower() in TEXT_SUFFIXES)
    keep_dir = keep_dir or (lambda name: True)
    skip = skip_dir.resolve() if skip_dir is not None else None
    found: dict[Path, Piece] = {}
    for item in inputs:
        path = Path(item)
        if path.is_file():
            pieces: Iterable[Piece] = [_piece(path, path.name)]
        elif path.is_dir():
            pieces = _walk(path, keep_file, keep_dir, skip)
        else:
            raise DataError(f"input {str(path)!r}: no such file or directory")
        for piece in pieces:
            found.setdefault(piece.path.resolve(), piece)
    return sorted((p for p in found.values() if p.stop > 0), key=lambda p: (p.rel, str(p.path)))


def stdlib_files() -> tuple[list[Piece], str]:
    """The ``*.py`` sources of the running Python's standard library, and a description of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces = collect_files(
        [root],
        keep_file=lambda n: n.endswith(".py") and not n.startswith("_sysconfigdata"),
        keep_dir=lambda n: n not in STDLIB_EXCLUDED_DIRS and not n.startswith("config-"),
    )
    return pieces, f"builtin:stdlib (Python {platform.python_version()} standard library at {root})"


# ---------------------------------------------------------------- budget and split


def apply_budget(pieces: list[Piece], max_bytes: int | None) -> list[Piece]:
    """A deterministic subset of about ``max_bytes`` bytes, spread over the corpus."""
    if max_bytes is None or sum(p.stop for p in pieces) <= max_bytes:
        return pieces
    chosen, left = [], max_bytes
    for piece in sorted(pieces, key=lambda p: (path_hash(p.rel, "select"), p.rel)):
        if left <= 0:
            break
        take = min(piece.stop, left)
        chosen.append(Piece(piece.path, piece.rel, 0, take, piece.mtime_ns))
        left -= take
    return sorted(chosen, key=lambda p: (p.rel, str(p.path)))


def _split_single(piece: Piece, val_fraction: float) -> dict[str, list[Piece]]:
    """One file: the last ``val_fraction`` of it (cut at a line break when possible) is val."""
    if piece.stop < 2:
        raise DataError(f"{piece.path}: too small to split into train and val; give more text")
    cut = piece.stop - max(1, int(piece.stop * val_fraction))
    newline = piece.read().rfind(b"\n", 0, cut)
    if newline + 1 >= cut - (piece.stop - cut):  # a line break not far before the cut
        cut = newline + 1
    return {
        "train": [Piece(piece.path, piece.rel, 0, cut, piece.mtime_ns)],
        "val": [Piece(piece.path, piece.rel, cut, piece.stop, piece.mtime_ns)],
    }


def split_files(pieces: list[Piece], val_fraction: float) -> dict[str, list[Piece]]:
    """Assign each file to train or val by the hash of its relative path (see module docstring)."""
    if len(pieces) == 1:
        return _split_single(pieces[0], val_fraction)
    val = [p for p in pieces if path_hash(p.rel) < val_fraction]
    train = [p for p in pieces if path_hash(p.rel) >= val_fraction]
    if not val:  # the file closest to the threshold moves
        val = [min(train, key=lambda p: (path_hash(p.rel), p.rel))]
        train = [p for p in train if p is not val[0]]
    if not train:
        train = [max(val, key=lambda p: (path_hash(p.rel), p.rel))]
        val = [p for p in val if p is not train[0]]
    return {"train": train, "val": val}


# ---------------------------------------------------------------- writing shards


def _clear_outputs(out_dir: Path) -> None:
    """Remove a previous run's meta.json first (so a crash never looks complete), then its shards."""
    (out_dir / META_NAME).unlink(missing_ok=True)
    (out_dir / META_PKL).unlink(missing_ok=True)
    for path in out_dir.iterdir():
        if SHARD_NAME.match(path.name):
            path.unlink()


def _tokenize_splits(
    splits: dict[str, list[Piece]], tok: Tokenizer, out_dir: Path, options: dict, quiet: bool
) -> tuple[dict[str, dict], str]:
    """Tokenise every piece into shards; returns per-split stats and a content fingerprint."""
    dtype = np.uint16 if tok.vocab_size <= UINT16_LIMIT else np.uint32
    eot = np.array([] if tok.eot_id is None else [tok.eot_id], dtype=dtype)
    content = hashlib.sha256()
    stats: dict[str, dict] = {}
    total = sum(len(v) for v in splits.values())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=quiet) as progress:
        task = progress.add_task(f"tokenising {total} files", total=total)
        for split in SPLITS:
            writer: ShardWriter | NanoGPTWriter = (
                NanoGPTWriter(out_dir, split) if options["format"] == "nanogpt"
                else ShardWriter(out_dir, split, options["shard_tokens"]))
            for piece in splits[split]:
                data = piece.read()
                content.update(f"{split}:{piece.rel}:{piece.start}:{len(data)}\n".encode())
                content.update(data)
                writer.add(eot)
                writer.add(tok.encode(data).astype(dtype, copy=False))
                progress.advance(task)
            writer.close()
            stats[split] = {
                "tokens": writer.tokens,
                "files": len(splits[split]),
                "bytes": sum(p.stop - p.start for p in splits[split]),
                "shards": writer.names,
            }
    if options["format"] == "llmc":
        one_flavour(out_dir, [name for split in SPLITS for name in stats[split]["shards"]])
    else:
        write_meta_pkl(out_dir, tok.vocab_size)
    return stats, content.hexdigest()


# ---------------------------------------------------------------- the entry points


def _check_options(val_fraction: float, fmt: str, shard_tokens: int | None, max_bytes: int | None) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}; try 0.05")
    if fmt not in ("llmc", "nanogpt"):
        raise DataError(f"format {fmt!r} is not supported for writing; use 'llmc' or 'nanogpt'")
    if fmt == "nanogpt" and shard_tokens is not None:
        raise DataError(f"--shard-tokens {shard_tokens} applies to --format llmc: nanoGPT reads one train.bin "
                        "and one val.bin; leave --shard-tokens out")
    if shard_tokens is not None and not 1 <= shard_tokens <= MAX_SHARD_TOKENS:
        raise DataError(f"--shard-tokens {shard_tokens} is not allowed: between 1 and {MAX_SHARD_TOKENS} (the last "
                        f"shard takes the remainder and llm.c counts tokens in an int32); the default is "
                        f"{DEFAULT_SHARD_TOKENS}")
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"max_bytes must be >= 1 or unset, got {max_bytes}")


def _request(tok: Tokenizer, splits: dict[str, list[Piece]], options: dict) -> str:
    """A fingerprint of everything that determines the output (cheap: no file contents)."""
    files = {s: [(p.rel, p.start, p.stop, p.mtime_ns) for p in splits[s]] for s in SPLITS}
    blob = {"meta_version": META_VERSION, "options": options, "files": files}
    blob["tokenizer_sha256"] = getattr(tok, "sha256", None)
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def _existing(out_dir: Path, request: str) -> dict | None:
    """The meta.json of a finished earlier run with the same request, if its shards are all there."""
    path = out_dir / META_NAME
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("request_sha256") != request:
        return None
    if meta.get("format") == "nanogpt" and not (out_dir / META_PKL).is_file():
        return None
    try:
        for split in SPLITS:
            shards = [read_shard(out_dir / name, meta["format"]) for name in meta[split]["shards"]]
            if not shards or sum(len(s) for s in shards) != meta[split]["tokens"]:
                return None
    except (DataError, KeyError, TypeError):
        return None
    return meta


def _prepare(
    pieces: list[Piece],
    out_dir: str | Path,
    source: str,
    tokenizer: str,
    val_fraction: float,
    fmt: str,
    shard_tokens: int | None,
    max_bytes: int | None,
    quiet: bool,
) -> dict:
    out_dir = Path(out_dir)
    _check_options(val_fraction, fmt, shard_tokens, max_bytes)
    tok = load_tokenizer(tokenizer)
    if fmt == "llmc" and shard_tokens is None:
        shard_tokens = DEFAULT_SHARD_TOKENS
    if not pieces:
        raise DataError(
            f"no non-empty text files in {source}; suffixes read from directories: "
            f"{' '.join(sorted(TEXT_SUFFIXES))}"
        )
    selected = apply_budget(pieces, max_bytes)
    splits = split_files(selected, val_fraction)
    options = {
        "tokenizer": tok.spec,
        "val_fraction": val_fraction,
        "format": fmt,
        "shard_tokens": shard_tokens,
        "max_bytes": max_bytes,
    }
    request = _request(tok, splits, options)
    meta = _existing(out_dir, request)
    if meta is not None:
        if not quiet:
            print(f"recover prepare: {out_dir / META_NAME} matches these inputs and options; skipping")
        return {**meta, "skipped": True}
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out_dir)
    stats, content = _tokenize_splits(splits, tok, out_dir, options, quiet)
    meta = {
        "meta_version": META_VERSION,
        **options,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "tokenizer_sha256": getattr(tok, "sha256", None),
        "source": source,
        "split": "by-file" if len(selected) > 1 else "single-file-tail",
        **stats,
        "content_sha256": content,
        "request_sha256": request,
    }
    tmp = out_dir / f".{META_NAME}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / META_NAME)
    return {**meta, "skipped": False}


def prepare_files(
    inputs: list[Path],
    out_dir: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    fmt: str = "llmc",
    shard_tokens: int | None = None,
    max_bytes: int | None = None,
    quiet: bool = False,
) -> dict:
    """Tokenise text files/directories into ``out_dir`` (see the module docstring).

    Returns:
        The contents of ``meta.json`` plus ``"skipped"`` (True when an identical earlier run was found).

    Raises:
        DataError: missing inputs, no text files, a bad option, or an unusable tokenizer.
    """
    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise DataError("no inputs given; pass text files or directories, or use prepare_builtin('stdlib')")
    pieces = collect_files(inputs, skip_dir=Path(out_dir))
    more = f" and {len(inputs) - 5} more" if len(inputs) > 5 else ""
    shown = ", ".join(str(p) for p in inputs[:5]) + more
    return _prepare(
        pieces, out_dir, f"files: {shown}", tokenizer, val_fraction, fmt, shard_tokens, max_bytes, quiet
    )


def prepare_builtin(
    name: str,
    out_dir: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    fmt: str = "llmc",
    shard_tokens: int | None = None,
    max_bytes: int | None = None,
    quiet: bool = False,
) -> dict:
    """Prepare an embedded corpus that needs no network. ``"stdlib"``: this Python's stdlib sources.

    Raises:
        DataError: an unknown corpus name, or as :func:`prepare_files`.
    """
    if name not in BUILTIN_CORPORA:
        raise DataError(f"unknown builtin corpus {name!r}; available: {', '.join(BUILTIN_CORPORA)}")
    pieces, source = stdlib_files()
    return _prepare(pieces, out_dir, source, tokenizer, val_fraction, fmt, shard_tokens, max_bytes, quiet)


BUILTIN_PREFIX = "builtin:"


def resolve_data_dir(cfg: DataConfig, prepare: bool = True, quiet: bool = False) -> Path:
    """The shard directory of ``cfg.path`` (of the first source of ``cfg.sources``; every builtin one is
    prepared); ``builtin:NAME`` is prepared on first use."""
    if cfg.sources:
        return [resolve_data_dir(part, prepare, quiet) for part, _ in cfg.parts()][0]
    if cfg.path.startswith(BUILTIN_PREFIX):
        name = cfg.path[len(BUILTIN_PREFIX):]
        out = Path(cfg.cache_dir) / name
        if prepare:
            prepare_builtin(name, out, quiet=quiet)
        return out
    path = Path(cfg.path)
    if not path.is_dir():
        raise ConfigError(f"data.path = {cfg.path!r} is not a directory; prepare one with "
                          "`recover prepare FILES --out DIR` or use 'builtin:stdlib'")
    return path
