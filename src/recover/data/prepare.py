"""Tokenise text files, JSONL and Parquet into train/val token shards plus a ``meta.json``.

Contract:
    * Inputs are files or directories (walked recursively, hidden entries skipped). A directory
      contributes text files (by suffix), ``*.jsonl`` and ``*.parquet``; a file given directly is
      always taken. Files are processed in sorted order of their relative path, so the output is the
      same on every machine and for every order in which inputs were listed or created.
    * Documents: a text file is one document; a ``.jsonl`` line is one, its string field ``field``
      (``"text"``); a Parquet row is one, its string column ``column`` (``"text"``; reading Parquet
      needs the optional ``pyarrow``: ``pip install 'recover-llm[parquet]'``). Empty ones are
      skipped; a row without the field, or not a string, is refused in one line naming file, row and
      field. Every document is preceded by the tokenizer's end-of-text id (llm.c convention), so
      documents are always separated by EOT (a tokenizer without one, which meta.json records as
      ``eot_id: null``, gets its documents simply concatenated).
    * The split is BY FILE: a file goes to val when a stable hash (sha256) of its relative path falls
      below ``val_fraction``. It never depends on file order, on other files or on the machine.
      Val and train each get at least one file; a single input file is split by its tail instead
      (text: bytes, cut at a line break when one is near; JSONL and Parquet: rows).
    * ``max_bytes`` keeps a deterministic, well-spread subset: files in order of a second (salted)
      path hash until the budget is spent; the last one may be cut (JSONL: after the line the budget
      ends in; Parquet: a share of its rows in proportion to the file's size).
    * All cores: the work is cut into tasks of about ``TASK_BYTES`` (whole small files together, a
      JSONL file at line breaks, a Parquet file by row groups and rows, a text file longer than
      ``PIECE_BYTES`` into pieces at line breaks between two printable ASCII characters, where a
      byte-level BPE such as GPT-2's or Llama 3's splits anyway). ``workers`` processes (spawned, each
      loading the tokenizer from its spec) tokenise them; the parent writes results in corpus order,
      holding at most a few tasks and one shard in memory. The cuts depend on the input only, so the
      output bytes are the same for every ``workers`` (default: every core the process may use; one for
      the byte tokenizer, which is faster alone).
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
    * Resumable: after each complete shard (nanoGPT: each complete split file),
      ``out_dir/.prepare-journal.json`` is replaced atomically; it records the request's fingerprint, the complete
      shards (tokens, max id, checksum) and where in the task list the next shard starts. A re-run of
      the same request after a crash keeps those shards (when their checksums still match) and goes
      on from there, giving the same bytes as an uninterrupted run; any other request clears the
      directory's shards and starts over. The journal is removed once ``meta.json`` is written.
    * ``meta.json`` holds the options, ``vocab_size``, ``eot_id``, ``source``, ``split``, per split
      ``{"tokens", "files", "documents", "bytes" (of document text), "shards" (names, in order),
      "max_id"}``, ``"max_id"`` (the largest id in any shard, -1 when none), ``"shard_info"``: shard file
      name -> ``{"tokens", "max_id", "blake2b"}`` (blake2b: :func:`file_blake2b` of the file's bytes,
      header included), ``content_sha256`` and ``request_sha256``. Data can be checked against a model
      from these fields alone: ``max_id < vocab_size``, and a shard's size and checksum unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import platform
import re
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from recover.config import DataConfig
from recover.data.layout import BUILTIN_PREFIX, META_PKL, resolve_data_dir
from recover.data.shards import META_NAME, UINT16_LIMIT, read_shard
from recover.data.tokenizer import BYTE_SPEC, Tokenizer, load_tokenizer
from recover.data.writers import NanoGPTWriter, ShardWriter, file_blake2b, one_flavour, write_meta_pkl
from recover.errors import DataError

META_VERSION = 2
SPLITS = ("train", "val")
BUILTIN_CORPORA = ("stdlib",)
TEXT_SUFFIXES = frozenset(
    ".txt .md .rst .tex .org .py .pyi .json .csv .tsv .html .htm .xml .yaml .yml .toml .ini .cfg "
    ".c .h .cc .cpp .hpp .rs .go .java .js .ts .sh .sql .r .jl .lua .rb".split()
)
ROW_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}  # one document per line / row
INPUT_SUFFIXES = TEXT_SUFFIXES | ROW_SUFFIXES.keys()
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
)
SHARD_NAME = re.compile(r"^(train|val)(_\d{6})?\.bin$")
LEFTOVER_NAME = re.compile(r"^\.(train|val)(_\d{6})?\.bin\.tmp\d+$")  # a writer killed mid-file
DEFAULT_SHARD_TOKENS = 50_000_000
MAX_SHARD_TOKENS = (2**31 - 1) // 2  # llm.c's header counts tokens in an int32; the last shard may double
DEFAULT_FIELD = DEFAULT_COLUMN = "text"
TASK_BYTES = 1 << 21  # about this much text per task sent to a worker
PIECE_BYTES = 1 << 24  # a text file longer than this is tokenised in pieces (see the module docstring)
JOURNAL_NAME = ".prepare-journal.json"
JOURNAL_VERSION = 1
NEWLINE = re.compile(rb"\n")
TEXT_CUT = re.compile(rb"(?<=[\x21-\x7e])\n(?=[\x21-\x7e])")  # a line break between printable ASCII
BLOCK = 1 << 20
JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "an array",
              dict: "an object"}


@dataclass(frozen=True)
class Piece:
    """Part of one source file: bytes ``[start, stop)`` of a text file (one document) or of a JSONL
    file (whole lines, a document each), or rows ``[start, stop)`` of a Parquet file."""

    path: Path
    rel: str  # relative path, '/'-separated: the file's identity for split and order
    start: int
    stop: int
    mtime_ns: int
    kind: str = "text"  # "text", "jsonl" or "parquet"
    size: int = 0  # the whole file's bytes
    rows: int = 0  # Parquet: the whole file's rows

    @property
    def nbytes(self) -> int:
        """Bytes of the file this piece stands for (Parquet: its rows' share of the file)."""
        if self.kind == "parquet":
            return self.size * (self.stop - self.start) // max(1, self.rows)
        return self.stop - self.start

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read(self.stop - self.start)


def path_hash(rel: str, salt: str = "split") -> float:
    """A stable number in [0, 1) for a relative path (same on every machine and run)."""
    digest = hashlib.sha256(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def file_kind(path: Path) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"``, by suffix."""
    return ROW_SUFFIXES.get(path.suffix.lower(), "text")


def _parquet(path: str | Path) -> Any:
    """``pyarrow.parquet``, imported only when a Parquet input is met."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs the optional 'pyarrow' package, which is not installed: "
                        "pip install 'recover-llm[parquet]' (or pip install pyarrow)") from None
    return pq


def _parquet_metadata(path: Path) -> Any:
    try:
        return _parquet(path).read_metadata(path)
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{path}: not a readable Parquet file ({exc}); check the file or leave it out") from None


# ---------------------------------------------------------------- searching files without reading them whole


def _search(path: Path, pos: int, stop: int, pattern: re.Pattern[bytes], limit: int | None = None) -> int | None:
    """The offset just after the first match of ``pattern`` starting in ``[pos, min(stop, pos + limit))``
    of a file (one byte of context either side is visible), or None."""
    end = stop if limit is None else min(stop, pos + limit)
    with open(path, "rb") as f:
        for at in range(pos, end, BLOCK):
            begin = max(0, at - 1)
            f.seek(begin)
            block = f.read(min(BLOCK, end - at) + (at - begin) + 1)
            match = pattern.search(block, at - begin)
            if match is not None and begin + match.start() < end:
                return begin + match.end()
    return None


def _line_offset(path: Path, start: int, stop: int, lines: int) -> int:
    """The offset just after the ``lines``-th line break in ``[start, stop)`` (``stop`` if fewer)."""
    with open(path, "rb") as f:
        f.seek(start)
        at = start
        while lines > 0 and at < stop:
            block = f.read(min(BLOCK, stop - at))
            count = block.count(b"\n")
            if count < lines:
                lines -= count
                at += len(block)
                continue
            index = -1
            for _ in range(lines):
                index = block.index(b"\n", index + 1)
            return at + index + 1
    return stop


def _count_lines(path: Path, start: int, stop: int) -> int:
    """Lines in ``[start, stop)``, a last one without a line break included."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        f.seek(start)
        for at in range(start, stop, BLOCK):
            block = f.read(min(BLOCK, stop - at))
            count += block.count(b"\n")
            last = block[-1:] or last
    return count + (last != b"\n")


# ---------------------------------------------------------------- collecting files


def _piece(path: Path, rel: str) -> Piece:
    st = path.stat()
    kind = file_kind(path)
    if kind == "parquet":
        rows = _parquet_metadata(path).num_rows
        return Piece(path, rel, 0, rows, st.st_mtime_ns, kind, st.st_size, rows)
    return Piece(path, rel, 0, st.st_size, st.st_mtime_ns, kind, st.st_size)


def _identity(path: str | Path) -> tuple[int, int]:
    """The file a path leads to (symbolic links followed): cheaper than resolving it."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk(
    root: Path, keep_file: Callable[[str], bool], keep_dir: Callable[[str], bool], skip: tuple[int, int] | None
) -> Iterable[Piece]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and keep_dir(d) and (skip is None or _identity(os.path.join(dirpath, d)) != skip)
        )
        prefix = Path(dirpath).relative_to(root).as_posix() + "/"
        prefix = "" if prefix == "./" else prefix
        for name in sorted(filenames):
            if not name.startswith(".") and keep_file(name):
                yield _piece(Path(dirpath, name), prefix + name)


def _is_input(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in INPUT_SUFFIXES


def collect_files(
    inputs: Iterable[str | Path],
    keep_file: Callable[[str], bool] | None = None,
    keep_dir: Callable[[str], bool] | None = None,
    skip_dir: Path | None = None,
) -> list[Piece]:
    """Non-empty input files under ``inputs``, deduplicated, sorted by relative path.

    A file given directly is always taken (its relative path is its name); a directory contributes
    files accepted by ``keep_file`` (default: text suffixes, ``.jsonl`` and ``.parquet``) under
    directories accepted by ``keep_dir``, relative to that directory. ``skip_dir`` (the output
    directory) is never entered.
    """
    keep_file = keep_file or _is_input
    keep_dir = keep_dir or (lambda name: True)
    skip = _identity(skip_dir) if skip_dir is not None and skip_dir.is_dir() else None
    found: dict[tuple[int, int], Piece] = {}
    for item in inputs:
        path = Path(item)
        if path.is_file():
            pieces: Iterable[Piece] = [_piece(path, path.name)]
        elif path.is_dir():
            pieces = _walk(path, keep_file, keep_dir, skip)
        else:
            raise DataError(f"input {str(path)!r}: no such file or directory")
        for piece in pieces:
            found.setdefault(_identity(piece.path), piece)
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


def _prefix(piece: Piece, nbytes: int) -> Piece:
    """The first ``nbytes`` or so of a piece: bytes (text), whole lines (JSONL) or rows (Parquet)."""
    if piece.kind == "text":
        return dataclasses.replace(piece, stop=piece.start + nbytes)
    if piece.kind == "jsonl":  # to the end of the line the budget ends in
        end = _search(piece.path, piece.start + nbytes - 1, piece.stop, NEWLINE)
        return dataclasses.replace(piece, stop=piece.stop if end is None else end)
    rows = -(-(piece.stop - piece.start) * nbytes // piece.nbytes)
    return dataclasses.replace(piece, stop=piece.start + max(1, rows))


def apply_budget(pieces: list[Piece], max_bytes: int | None) -> list[Piece]:
    """A deterministic subset of about ``max_bytes`` bytes, spread over the corpus."""
    if max_bytes is None or sum(p.nbytes for p in pieces) <= max_bytes:
        return pieces
    chosen, left = [], max_bytes
    for piece in sorted(pieces, key=lambda p: (path_hash(p.rel, "select"), p.rel)):
        if left <= 0:
            break
        take = piece if piece.nbytes <= left else _prefix(piece, left)
        chosen.append(take)
        left -= take.nbytes
    return sorted(chosen, key=lambda p: (p.rel, str(p.path)))


def _split_single(piece: Piece, val_fraction: float) -> dict[str, list[Piece]]:
    """One file: its last ``val_fraction`` is val: bytes (cut at a line break when one is near) for
    text, rows for JSONL and Parquet."""
    if piece.kind == "text":
        if piece.stop - piece.start < 2:
            raise DataError(f"{piece.path}: too small to split into train and val; give more text")
        cut = piece.stop - max(1, int(piece.stop * val_fraction))
        lo = max(piece.start, 2 * cut - piece.stop - 1)  # a line break not far before the cut
        with open(piece.path, "rb") as f:
            f.seek(lo)
            newline = f.read(cut - lo).rfind(b"\n")
        if newline >= 0:
            cut = lo + newline + 1
    else:
        rows = (piece.stop - piece.start if piece.kind == "parquet"
                else _count_lines(piece.path, piece.start, piece.stop))
        if rows < 2:
            raise DataError(f"{piece.path}: {rows} row(s), too few to split into train and val; give more rows "
                            "or more files")
        train_rows = rows - max(1, int(rows * val_fraction))
        cut = (piece.start + train_rows if piece.kind == "parquet"
               else _line_offset(piece.path, piece.start, piece.stop, train_rows))
    return {
        "train": [dataclasses.replace(piece, stop=cut)],
        "val": [dataclasses.replace(piece, start=cut)],
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


# ---------------------------------------------------------------- cutting the work into tasks


@dataclass(frozen=True)
class Chunk:
    """What one worker call reads of a piece: bytes or rows ``[start, stop)``. ``first``: a text chunk
    that begins its document (EOT goes before it). ``key``: the JSONL field or Parquet column.
    ``weight``: the bytes of text it stands for."""

    kind: str
    path: str
    rel: str
    start: int
    stop: int
    first: bool
    key: str
    weight: int


def _parquet_chunks(piece: Piece, column: str) -> list[Chunk]:
    """Row groups (and rows of a group larger than a task) of a Parquet piece."""
    meta = _parquet_metadata(piece.path)
    leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if column not in leaves:
        raise DataError(f"{piece.path}: no column {column!r} (it has {', '.join(leaves)}); pass --column NAME of "
                        "the column that holds each document's text")
    leaf = leaves.index(column)
    chunks, offset = [], 0
    for group in range(meta.num_row_groups):
        rg = meta.row_group(group)
        lo, hi, offset = offset, offset + rg.num_rows, offset + rg.num_rows
        start, stop = max(lo, piece.start), min(hi, piece.stop)
        if start >= stop:
            continue
        text_bytes = max(1, rg.column(leaf).total_uncompressed_size)
        step = max(1, rg.num_rows * TASK_BYTES // text_bytes)
        for a in range(start, stop, step):
            b = min(stop, a + step)
            chunks.append(Chunk("parquet", str(piece.path), piece.rel, a, b, True, column,
                                text_bytes * (b - a) // rg.num_rows))
    return chunks


def _chunks(piece: Piece, field: str, column: str) -> list[Chunk]:
    """A piece cut where the module docstring says; the cuts depend on the file's bytes only."""
    if piece.kind == "parquet":
        return _parquet_chunks(piece, column)
    step = PIECE_BYTES if piece.kind == "text" else TASK_BYTES
    cuts, target = [piece.start], piece.start + step
    while target < piece.stop:
        if piece.kind == "text":  # within a step after the target, else no cut there
            at = _search(piece.path, target, piece.stop, TEXT_CUT, step)
            at = at or _search(piece.path, target, piece.stop, NEWLINE, step)
        else:  # a JSONL line is never cut
            at = _search(piece.path, target, piece.stop, NEWLINE)
            if at is None:
                break
        if at is not None and at < piece.stop:
            cuts.append(at)
        target = (at or target) + step
    bounds = zip(cuts, cuts[1:] + [piece.stop], strict=True)
    return [Chunk(piece.kind, str(piece.path), piece.rel, a, b, a == piece.start, field, b - a) for a, b in bounds]


def _tasks(splits: dict[str, list[Piece]], field: str, column: str) -> list[tuple[str, tuple[Chunk, ...]]]:
    """The work in corpus order, as ``(split, chunks)`` of about ``TASK_BYTES`` each."""
    tasks = []
    for split in SPLITS:
        batch: list[Chunk] = []
        weight = 0
        for piece in splits[split]:
            for chunk in _chunks(piece, field, column):
                batch.append(chunk)
                weight += chunk.weight
                if weight >= TASK_BYTES:
                    tasks.append((split, tuple(batch)))
                    batch, weight = [], 0
        if batch:
            tasks.append((split, tuple(batch)))
    return tasks


# ---------------------------------------------------------------- tokenising (in the workers)


class Tokenized(NamedTuple):
    tokens: np.ndarray  # EOT before each document
    documents: int
    bytes: int  # of document text
    digest: bytes  # sha256 of the chunks' positions and documents


def _line_number(chunk: Chunk, index: int) -> int:
    """The 1-based line of the file that is line ``index`` of the chunk (only for error messages)."""
    return _count_lines(Path(chunk.path), 0, chunk.start) + index + 1  # chunks start after a line break


def _jsonl_rows(chunk: Chunk) -> Iterator[str]:
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.stop - chunk.start)
    for index, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{chunk.path}, line {_line_number(chunk, index)}: not valid JSON ({exc}); each line "
                            "of a .jsonl file must be one JSON object") from None
        value = row.get(chunk.key) if isinstance(row, dict) else None
        if not isinstance(value, str):
            what = ("is not a JSON object" if not isinstance(row, dict)
                    else f"has no field {chunk.key!r}" if chunk.key not in row
                    else f"field {chunk.key!r} is {JSON_TYPES.get(type(value), type(value).__name__)}, not a string")
            raise DataError(f"{chunk.path}, line {_line_number(chunk, index)}: {what}; pass --field NAME of the "
                            "string field that holds each document's text")
        yield value


def _parquet_rows(chunk: Chunk) -> Iterator[str]:
    pq = _parquet(chunk.path)
    with pq.ParquetFile(chunk.path) as file:
        offset = 0
        for group in range(file.metadata.num_row_groups):
            lo = offset
            offset += file.metadata.row_group(group).num_rows
            start, stop = max(lo, chunk.start), min(offset, chunk.stop)
            if start >= stop:
                continue
            column = file.read_row_group(group, columns=[chunk.key], use_threads=False).column(0)
            if str(column.type) not in ("string", "large_string", "string_view"):
                raise DataError(f"{chunk.path}: column {chunk.key!r} holds {column.type}, not text; pass --column "
                                "NAME of a string column")
            for index, value in enumerate(column.slice(start - lo, stop - start).to_pylist()):
                if not isinstance(value, str):
                    raise DataError(f"{chunk.path}, row {start + index + 1}: column {chunk.key!r} is null, not a "
                                    "string; drop such rows or pass --column NAME of a column without nulls")
                yield value


def _documents(chunk: Chunk) -> Iterator[tuple[bytes | str, bool]]:
    """A chunk's documents and whether each begins a document (gets an EOT before it)."""
    if chunk.kind == "text":
        with open(chunk.path, "rb") as f:
            f.seek(chunk.start)
            yield f.read(chunk.stop - chunk.start), chunk.first
    else:
        for row in _jsonl_rows(chunk) if chunk.kind == "jsonl" else _parquet_rows(chunk):
            yield row, True


def _tokenize(chunks: tuple[Chunk, ...], tok: Tokenizer) -> Tokenized:
    dtype = np.uint16 if tok.vocab_size <= UINT16_LIMIT else np.uint32
    eot = np.array([] if tok.eot_id is None else [tok.eot_id], dtype=dtype)
    parts, documents, nbytes, digest = [], 0, 0, hashlib.sha256()
    for chunk in chunks:
        digest.update(f"{chunk.rel}:{chunk.start}:{chunk.stop}\n".encode())
        for text, first in _documents(chunk):
            data = text.encode() if isinstance(text, str) else text
            if not data:
                continue
            digest.update(len(data).to_bytes(8, "little") + data)
            if first:
                parts.append(eot)
                documents += 1
            parts.append(tok.encode(text).astype(dtype, copy=False))
            nbytes += len(data)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return Tokenized(tokens, documents, nbytes, digest.digest())


_worker_tokenizer: Tokenizer | None = None


def _start_worker(spec: str) -> None:
    """A pool process's initializer: its own tokenizer, loaded from the spec (nothing is inherited)."""
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec)


def _work(chunks: tuple[Chunk, ...]) -> Tokenized:
    assert _worker_tokenizer is not None, "_start_worker was not run"
    return _tokenize(chunks, _worker_tokenizer)


def _pool_size(tasks: list[tuple[Chunk, ...]], workers: int) -> int:
    """The processes to use: 1 (no pool) for fewer than two tasks' worth of work, where starting a pool
    would take longer than the work, else ``workers`` (at most one per task)."""
    if len(tasks) < 2 or sum(c.weight for chunks in tasks for c in chunks) < 2 * TASK_BYTES:
        return 1
    return min(workers, len(tasks))


def _results(tasks: list[tuple[Chunk, ...]], tok: Tokenizer, workers: int) -> Iterator[Tokenized]:
    """The tasks' results in order, from a spawned pool of ``workers`` processes (at most two tasks
    each in flight) or, for 1, from this process."""
    if workers == 1:
        for chunks in tasks:
            yield _tokenize(chunks, tok)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tok.spec,)) as pool:
        queue = iter(tasks)
        pending = deque(pool.apply_async(_work, (chunks,)) for chunks in itertools.islice(queue, 2 * workers))
        while pending:
            result = pending.popleft().get()
            pending.extend(pool.apply_async(_work, (chunks,)) for chunks in itertools.islice(queue, 1))
            yield result


def default_workers(tok: Tokenizer | None = None) -> int:
    """The CPU cores this process may use; 1 for the byte tokenizer, which encodes at memory speed: more
    processes only add copies (``recover bench data``: 0.23x with 2 on 2 cores)."""
    if tok is not None and tok.spec == BYTE_SPEC:
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------- the journal: resuming after a crash


def _fingerprint(request: str) -> str:
    """What a journal must match to be resumed: the request and how it is cut into tasks."""
    return hashlib.sha256(f"{JOURNAL_VERSION}:{request}:{TASK_BYTES}:{PIECE_BYTES}".encode()).hexdigest()


def _save_journal(out_dir: Path, journal: dict) -> None:
    tmp = out_dir / f"{JOURNAL_NAME}.tmp"
    tmp.write_text(json.dumps(journal))
    os.replace(tmp, out_dir / JOURNAL_NAME)


def _load_journal(out_dir: Path, fingerprint: str) -> dict | None:
    """The journal of an interrupted run of the same request whose shards are all intact, else None."""
    try:
        journal = json.loads((out_dir / JOURNAL_NAME).read_text())
        if journal["fingerprint"] != fingerprint:
            return None
        for split in SPLITS:
            for name, info in journal["shards"][split]:
                if not SHARD_NAME.match(name) or file_blake2b(out_dir / name) != info["blake2b"]:
                    return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return journal


def _start(out_dir: Path, fingerprint: str) -> dict:
    """The journal to go on from (a fresh one unless an interrupted run of the same request left one);
    removes meta.json first (so a crash never looks complete), then every shard the journal does not
    keep and any half-written file."""
    journal = _load_journal(out_dir, fingerprint)
    (out_dir / META_NAME).unlink(missing_ok=True)
    (out_dir / META_PKL).unlink(missing_ok=True)
    kept = set() if journal is None else {name for split in SPLITS for name, _ in journal["shards"][split]}
    for path in out_dir.iterdir():
        if (SHARD_NAME.match(path.name) and path.name not in kept) or LEFTOVER_NAME.match(path.name):
            path.unlink()
    if journal is None:
        journal = {
            "journal_version": JOURNAL_VERSION,
            "fingerprint": fingerprint,
            "shards": {split: [] for split in SPLITS},  # [name, {"tokens", "max_id", "blake2b"}], in order
            "closed": {},  # split -> {"tokens", "documents", "bytes"} once its last shard is final
            # where the next shard starts: tokens [0, skip) of task `task` are in shards; chain, documents
            # and bytes are as they were before that task
            "resume": {"task": 0, "skip": 0, "chain": "", "documents": 0, "bytes": 0},
        }
        _save_journal(out_dir, journal)
    return journal


# ---------------------------------------------------------------- writing shards


def _chain(chain: str, split: str, digest: bytes) -> str:
    return hashlib.sha256(bytes.fromhex(chain) + split.encode() + digest).hexdigest()


def _progress(quiet: bool) -> Progress:
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[rate]}"),
               TimeElapsedColumn())
    return Progress(*columns, disable=quiet)


def _write_splits(
    tasks: list[tuple[str, tuple[Chunk, ...]]],
    tok: Tokenizer,
    out_dir: Path,
    options: dict,
    journal: dict,
    workers: int,
    quiet: bool,
) -> str:
    """Tokenises the tasks from the journal's resume point on, writing shards and the journal as they
    complete; returns the content fingerprint (a sha256 chain over every task, in order)."""
    resume = journal["resume"]
    first, skip = resume["task"], resume["skip"]
    chain, documents, nbytes = resume["chain"], resume["documents"], resume["bytes"]
    last = {split: t for t, (split, _) in enumerate(tasks)}
    weights = [sum(c.weight for c in chunks) for _, chunks in tasks]
    writer: ShardWriter | NanoGPTWriter | None = None
    todo = [chunks for _, chunks in tasks[first:]]
    workers = _pool_size(todo, workers)
    # closing(): a failure while writing stops the pool at once, not when the traceback is dropped
    with _progress(quiet) as progress, contextlib.closing(_results(todo, tok, workers)) as results:
        bar = progress.add_task(f"tokenising, {workers} process(es)", total=sum(weights),
                                completed=sum(weights[:first]), rate="")
        began, written = time.perf_counter(), 0
        for t, result in enumerate(results, start=first):
            split = tasks[t][0]
            if writer is None:
                done = [(name, info) for name, info in journal["shards"][split]]
                writer = (NanoGPTWriter(out_dir, split) if options["format"] == "nanogpt"
                          else ShardWriter(out_dir, split, options["shard_tokens"], done))
            cut = skip if t == first else 0
            begin, complete = writer.tokens - cut, len(writer.info)  # the split's position at this task
            writer.add(result.tokens[cut:])
            if len(writer.info) > complete:  # one or more shards complete: where the next one starts
                journal["shards"][split] = [[name, writer.info[name]] for name in writer.names]
                end = sum(info["tokens"] for info in writer.info.values())
                journal["resume"] = {"task": t, "skip": end - begin, "chain": chain, "documents": documents,
                                     "bytes": nbytes}
                _save_journal(out_dir, journal)
            chain = _chain(chain, split, result.digest)
            documents, nbytes = documents + result.documents, nbytes + result.bytes
            if t == last[split]:
                writer.close()
                journal["shards"][split] = [[name, writer.info[name]] for name in writer.names]
                journal["closed"][split] = {"tokens": writer.tokens, "documents": documents, "bytes": nbytes}
                journal["resume"] = {"task": t + 1, "skip": 0, "chain": chain, "documents": 0, "bytes": 0}
                _save_journal(out_dir, journal)
                writer, documents, nbytes = None, 0, 0
            written += len(result.tokens) - cut
            rate = f"{written / max(time.perf_counter() - began, 1e-9):,.0f} tokens/s"
            progress.update(bar, advance=weights[t], rate=rate)
    return chain


# ---------------------------------------------------------------- the entry points


def _check_options(
    val_fraction: float, fmt: str, shard_tokens: int | None, max_bytes: int | None, workers: int | None
) -> None:
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
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise DataError(f"--workers {workers!r} is not allowed: a whole number >= 1, or leave it out for the "
                        f"{default_workers()} cores this process may use")


def _request(tok: Tokenizer, splits: dict[str, list[Piece]], options: dict) -> str:
    """A fingerprint of everything that determines the output (cheap: no file contents)."""
    files = {s: [(p.rel, p.kind, p.start, p.stop, p.size, p.mtime_ns) for p in splits[s]] for s in SPLITS}
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
    workers: int | None = None,
    field: str = DEFAULT_FIELD,
    column: str = DEFAULT_COLUMN,
) -> dict:
    out_dir = Path(out_dir)
    _check_options(val_fraction, fmt, shard_tokens, max_bytes, workers)
    tok = load_tokenizer(tokenizer)
    if fmt == "llmc" and shard_tokens is None:
        shard_tokens = DEFAULT_SHARD_TOKENS
    if not pieces:
        raise DataError(
            f"no non-empty input files in {source}; read from directories: *.jsonl, *.parquet and text files "
            f"({' '.join(sorted(TEXT_SUFFIXES))})"
        )
    selected = apply_budget(pieces, max_bytes)
    splits = split_files(selected, val_fraction)
    kinds = {p.kind for p in selected}
    options = {
        "tokenizer": tok.spec,
        "val_fraction": val_fraction,
        "format": fmt,
        "shard_tokens": shard_tokens,
        "max_bytes": max_bytes,
        **({"field": field} if "jsonl" in kinds else {}),
        **({"column": column} if "parquet" in kinds else {}),
    }
    request = _request(tok, splits, options)
    meta = _existing(out_dir, request)
    if meta is not None:
        if not quiet:
            print(f"recover prepare: {out_dir / META_NAME} matches these inputs and options; skipping")
        return {**meta, "skipped": True, "resumed_shards": 0}
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = _tasks(splits, field, column)
    journal = _start(out_dir, _fingerprint(request))
    kept = sum(len(journal["shards"][split]) for split in SPLITS)
    if kept and not quiet:
        print(f"recover prepare: resuming an interrupted run of the same request in {out_dir}: "
              f"{kept} complete shard(s) kept")
    content = _write_splits(tasks, tok, out_dir, options, journal, default_workers(tok) if workers is None else workers,
                            quiet)
    shards = {split: [name for name, _ in journal["shards"][split]] for split in SPLITS}
    info = {name: info for split in SPLITS for name, info in journal["shards"][split]}
    if fmt == "llmc":
        for name in one_flavour(out_dir, shards["train"] + shards["val"]):
            info[name]["blake2b"] = file_blake2b(out_dir / name)
    else:
        write_meta_pkl(out_dir, tok.vocab_size)
    stats = {}
    for split in SPLITS:
        closed = journal["closed"][split]
        if not closed["documents"]:
            raise DataError(f"the {split} split has no documents: every file or row given to it is empty "
                            f"({', '.join(p.rel for p in splits[split][:3])}); give text, or check --field/--column")
        stats[split] = {
            "tokens": closed["tokens"],
            "files": len(splits[split]),
            "documents": closed["documents"],
            "bytes": closed["bytes"],
            "shards": shards[split],
            "max_id": max(info[name]["max_id"] for name in shards[split]),
        }
    meta = {
        "meta_version": META_VERSION,
        **options,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "tokenizer_sha256": getattr(tok, "sha256", None),
        "source": source,
        "split": "by-file" if len(selected) > 1 else "single-file-tail",
        **stats,
        "max_id": max(stats[split]["max_id"] for split in SPLITS),
        "shard_info": info,
        "content_sha256": content,
        "request_sha256": request,
    }
    tmp = out_dir / f".{META_NAME}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / META_NAME)
    (out_dir / JOURNAL_NAME).unlink(missing_ok=True)
    return {**meta, "skipped": False, "resumed_shards": kept}


def prepare_files(
    inputs: list[Path],
    out_dir: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    fmt: str = "llmc",
    shard_tokens: int | None = None,
    max_bytes: int | None = None,
    quiet: bool = False,
    workers: int | None = None,
    field: str = DEFAULT_FIELD,
    column: str = DEFAULT_COLUMN,
) -> dict:
    """Tokenise text files, JSONL, Parquet and directories of them into ``out_dir`` (see the module
    docstring). ``workers``: tokenising processes (default: the cores this process may use; the output
    is the same for any number). They are spawned, so a script that calls this needs the usual
    ``if __name__ == "__main__":`` guard. ``field``/``column``: the JSONL field / Parquet column of the text.

    Returns:
        The contents of ``meta.json`` plus ``"skipped"`` (True when an identical earlier run was found)
        and ``"resumed_shards"`` (complete shards kept from an interrupted run of the same request).

    Raises:
        DataError: missing inputs, no input files, a bad option or row, an unusable tokenizer, or a
            Parquet input without pyarrow.
    """
    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise DataError("no inputs given; pass text, .jsonl or .parquet files or directories, or use "
                        "prepare_builtin('stdlib')")
    pieces = collect_files(inputs, skip_dir=Path(out_dir))
    more = f" and {len(inputs) - 5} more" if len(inputs) > 5 else ""
    shown = ", ".join(str(p) for p in inputs[:5]) + more
    return _prepare(pieces, out_dir, f"files: {shown}", tokenizer, val_fraction, fmt, shard_tokens, max_bytes,
                    quiet, workers, field, column)


def prepare_builtin(
    name: str,
    out_dir: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    fmt: str = "llmc",
    shard_tokens: int | None = None,
    max_bytes: int | None = None,
    quiet: bool = False,
    workers: int | None = None,
) -> dict:
    """Prepare an embedded corpus that needs no network. ``"stdlib"``: this Python's stdlib sources.

    Raises:
        DataError: an unknown corpus name, or as :func:`prepare_files`.
    """
    if name not in BUILTIN_CORPORA:
        raise DataError(f"unknown builtin corpus {name!r}; available: {', '.join(BUILTIN_CORPORA)}")
    pieces, source = stdlib_files()
    return _prepare(pieces, out_dir, source, tokenizer, val_fraction, fmt, shard_tokens, max_bytes, quiet, workers)


def prepared_data_dir(cfg: DataConfig, quiet: bool = False) -> Path:
    """:func:`~recover.data.layout.resolve_data_dir`, every ``builtin:`` source prepared first (once: the
    cache is reused)."""
    for part, _ in (cfg.parts() if cfg.sources else [(cfg, 1.0)]):
        if part.path.startswith(BUILTIN_PREFIX):
            prepare_builtin(part.path[len(BUILTIN_PREFIX):], resolve_data_dir(part), quiet=quiet)
    return resolve_data_dir(cfg)
