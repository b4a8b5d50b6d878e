"""``recover prepare --verify DIR``: every token of a data directory checked once, and the record that
lets every later start-up skip the scan.

Contract:
    * :func:`verify` checks both splits of ``DIR`` (layout from :mod:`recover.data.layout`): each
      shard's header and size, every token id against a vocabulary (``vocab_size``, else the data's
      recorded one, :func:`recover.data.layout.data_vocab`; when none is known only the largest id is
      reported), and, when ``meta.json`` records them (``shard_info: {name: {"tokens", "max_id",
      "blake2b"}}``, written by ``recover prepare``), each shard's token count, largest id and blake2b
      (of the whole file, with the digest size of the recorded hex). Every problem is one line naming
      the file (and for an id: its token position and byte offset) and the fix; nothing stops at the
      first one.
    * Parallel: a pool of ``workers`` threads (default: every core this process may use) reduces
      :data:`CHUNK_BYTES` chunks, memory-mapped, with numpy, which releases the GIL (page faults
      included). A shard with a recorded checksum is read once, in order, by one thread (the digest is
      sequential); the others are split into chunks, so one large file uses every core.
    * The result is cached in ``DIR/.recover-verified.json`` (:data:`CACHE_NAME`): per shard, by its
      path relative to ``DIR``, its size, ``mtime_ns``, format, token count, largest id, the position of
      that id's first occurrence and its digest. A re-run scans only shards whose (size, mtime_ns,
      format) changed; the cache holds no vocabulary, so it answers for any model. Writing it is
      best-effort: a read-only directory gets a warning, not a failure.
    * :func:`recorded_maxima` is what launch uses instead of a scan (a ``stat`` per shard, already done,
      and two small JSON reads; the scan's imports are deferred so launch does not pay for them): per
      shard its largest id from a matching cache entry, else from ``meta.json``'s ``shard_info``, else
      ``meta.json``'s top-level ``max_id`` (for the shards its splits list), else None (unknown: launch
      does not scan, training checks each microbatch).
    * :func:`check_data` is the start-up check of a run's splits built on it (headers, sizes, the recorded
      vocabulary and largest ids, and that each source's training split fills a microbatch: no token
      read), so ``recover launch`` refuses bad data before it starts anything, in time independent of the
      data's size; :func:`check_windows` is that last rule, which the samplers apply too (the validation
      split: over every source together).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recover.data.layout import (
    SPLIT_OPTION,
    check_vocab_fits,
    data_vocab,
    split_format,
    split_paths,
    split_pattern,
)
from recover.data.shards import (
    META_NAME,
    ShardHeader,
    TokenDataset,
    load_meta,
    one_listing,
    read_header,
    vocab_error,
)
from recover.errors import DataError

if TYPE_CHECKING:
    from recover.config import DataConfig

CACHE_NAME = ".recover-verified.json"
CACHE_VERSION = 1
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Recorded:
    """A shard's largest token id, known without reading its tokens."""

    max_id: int
    position: int | None
    """Token position of its first occurrence, when known."""
    source: str
    """Where it was recorded (for messages)."""
    whole: bool = False
    """True when it is the largest id of the whole data (meta.json's top-level ``max_id``), not this shard's."""


def _rel(path: Path, directory: Path) -> str:
    if path.parent == directory:
        return path.name
    return Path(os.path.relpath(path, directory)).as_posix()


def cache_path(directory: str | Path) -> Path:
    return Path(directory) / CACHE_NAME


def load_cache(directory: str | Path) -> dict[str, dict]:
    """The cache's entries by shard path (relative to ``directory``); empty when absent or unreadable."""
    try:
        data = json.loads(cache_path(directory).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("shards"), dict):
        return {}
    return {k: v for k, v in data["shards"].items() if isinstance(v, dict)}


def _matches(entry: dict | None, header: ShardHeader) -> bool:
    return (entry is not None and entry.get("size") == header.size and entry.get("mtime_ns") == header.mtime_ns
            and entry.get("fmt") == header.fmt and entry.get("tokens") == header.count
            and isinstance(entry.get("max_id"), int))


def shard_info(meta: dict | None) -> dict[str, dict]:
    """``meta.json``'s per-shard records (``{name: {"tokens", "max_id", "blake2b"}}``), when present."""
    info = meta.get("shard_info") if meta else None
    return {k: v for k, v in info.items() if isinstance(v, dict)} if isinstance(info, dict) else {}


def _listed(meta: dict) -> set[str] | None:
    """The shard names ``meta.json``'s splits list, or None when it lists none."""
    names = [n for split in ("train", "val") if isinstance(meta.get(split), dict)
             for n in meta[split].get("shards") or [] if isinstance(n, str)]
    return set(names) or None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _stale_count(header: ShardHeader, recorded: int, meta_path: Path) -> str:
    return (f"{header.path}: holds {header.count} tokens but {meta_path} shard_info records {recorded}: it is not "
            "the shard `recover prepare` wrote; re-create the directory with `recover prepare` or restore the file")


def recorded_maxima(dataset: TokenDataset, directory: str | Path | None = None) -> list[Recorded | None]:
    """Per shard of ``dataset``, its largest token id as recorded in ``directory`` (default: the first
    shard's directory), without reading a token; see the module docstring for the order.

    Raises:
        DataError: ``meta.json`` is unreadable, or its ``shard_info`` records a token count the shard's
            header disagrees with (the shard was replaced after ``recover prepare``).
    """
    directory = Path(directory) if directory is not None else dataset.paths[0].parent
    cache = load_cache(directory)
    meta = load_meta(directory)
    info = shard_info(meta)
    meta_path = directory / META_NAME
    top = _int(meta.get("max_id")) if meta else None
    listed = _listed(meta) if meta else None
    out: list[Recorded | None] = []
    for header in dataset.headers:
        entry = cache.get(_rel(header.path, directory))
        rec = info.get(header.path.name, {})
        if _matches(entry, header):
            out.append(Recorded(entry["max_id"], _int(entry.get("max_pos")),
                                f"recorded by `recover prepare --verify` in {cache_path(directory)}"))
            continue
        tokens = _int(rec.get("tokens"))
        if tokens is not None and tokens != header.count:
            raise DataError(_stale_count(header, tokens, meta_path))
        if _int(rec.get("max_id")) is not None:
            out.append(Recorded(rec["max_id"], None, f"its max_id in {meta_path} shard_info"))
        elif top is not None and (listed is None or header.path.name in listed):
            out.append(Recorded(top, None, f"the largest in the data: max_id in {meta_path}", whole=True))
        else:
            out.append(None)
    return out


# ---------------------------------------------------------------- the scan


@dataclass
class _Shard:
    header: ShardHeader
    key: str
    want_digest: str | None
    chunk_max: list[int] = field(default_factory=list)
    digest: str | None = None


@dataclass
class VerifyResult:
    """What :func:`verify` found."""

    directory: Path
    shards: int
    tokens: int
    bytes_total: int
    bytes_scanned: int
    reused: int
    """Shards whose cache entry matched (not read again)."""
    seconds: float
    max_id: int
    vocab: tuple[int, str] | None
    problems: list[str]
    cache_warning: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        rate = self.bytes_scanned / self.seconds / 1e9 if self.seconds > 0 else 0.0
        read = (f"{self.shards - self.reused} read in {self.seconds:.1f} s ({rate:.2f} GB/s), {self.reused}"
                if self.reused < self.shards else "all")
        head = (f"verified {self.shards} shard(s), {self.tokens:,} tokens ({self.bytes_total / 1e9:.2f} GB) in "
                f"{self.directory}: {read} unchanged since the last --verify; largest token id {self.max_id}")
        if self.vocab is None:
            head += "; no vocabulary recorded for this data (give --vocab-size N to check the ids against a model)"
        elif self.max_id < self.vocab[0]:
            head += f", below vocab_size {self.vocab[0]} ({self.vocab[1]})"
        if self.ok:
            return head + ": OK"
        return head + f": {len(self.problems)} problem(s)"


def _chunks(header: ShardHeader) -> Iterator[tuple[int, int]]:
    """``(first token, tokens)`` of each chunk of a shard."""
    per = CHUNK_BYTES // header.dtype.itemsize
    for start in range(0, header.count, per):
        yield start, min(per, header.count - start)


def _tokens(header: ShardHeader, start: int, n: int) -> np.ndarray:
    """Tokens ``[start, start + n)`` of a shard, memory-mapped: numpy reduces the page cache in place,
    without the copy a ``read`` makes (measured 1.5x faster on cached data, the same from disk)."""
    try:
        return np.memmap(header.path, dtype=header.dtype, mode="r", offset=header.byte_offset(start), shape=(n,))
    except (OSError, ValueError) as exc:
        raise DataError(f"{header.path}: changed while it was being verified ({exc}); run `recover prepare "
                        "--verify` again once nothing writes it") from exc


def _scan_chunk(header: ShardHeader, start: int, n: int) -> int:
    return int(_tokens(header, start, n).max())


def _scan_hashed(shard: _Shard, advance: Callable[[int], None]) -> None:
    import hashlib

    header = shard.header
    digest = hashlib.blake2b(digest_size=len(shard.want_digest or "") // 2)
    if header.offset:
        with open(header.path, "rb") as f:
            digest.update(f.read(header.offset))
        advance(header.offset)
    for start, n in _chunks(header):
        arr = _tokens(header, start, n)
        digest.update(arr)
        shard.chunk_max.append(int(arr.max()))
        advance(n * header.dtype.itemsize)
    shard.digest = digest.hexdigest()


def _first(header: ShardHeader, test: Callable[[np.ndarray], np.ndarray], chunk_max: list[int] | None = None,
           threshold: int = 0, count: bool = False) -> tuple[int, int]:
    """``(position of the first token passing test or -1, how many pass)``, reading only the chunks whose
    max is >= ``threshold`` when ``chunk_max`` is known; stops at the first hit unless ``count``."""
    first, hits_total = -1, 0
    for k, (start, n) in enumerate(_chunks(header)):
        if chunk_max is not None and chunk_max[k] < threshold:
            continue
        hits = test(_tokens(header, start, n))
        c = int(np.count_nonzero(hits))
        if c and first < 0:
            first = start + int(np.argmax(hits))
            if not count:
                return first, c
        hits_total += c
    return first, hits_total


def _digest_ok(want: str | None) -> bool:
    return want is None or (isinstance(want, str) and 2 <= len(want) <= 128 and len(want) % 2 == 0
                            and all(c in "0123456789abcdef" for c in want.lower()))


def verify(directory: str | Path, vocab_size: int | None = None, *, workers: int | None = None,
           progress: bool = True, emit: Callable[[str], None] = print) -> VerifyResult:
    """Check every shard of both splits of ``directory`` (see the module docstring).

    Args:
        directory: a data directory in any layout of :mod:`recover.data.layout`.
        vocab_size: ids must be below it; default: the data's recorded vocabulary (none: not checked).
        workers: reading threads (default: the cores this process may use).
        progress: show a progress bar (bytes read, GB/s) on stderr.
        emit: receives each problem line as it is found.

    Raises:
        DataError: no shards (the layout is needed) or an unreadable ``meta.json``.
    """
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from recover.config import DataConfig

    t0 = time.perf_counter()
    directory = Path(directory)
    cfg = DataConfig(path=str(directory))
    vocab = (vocab_size, "--vocab-size") if vocab_size is not None else data_vocab(cfg, directory)
    meta = load_meta(directory)
    info = shard_info(meta)
    meta_path = directory / META_NAME
    cache = load_cache(directory)
    workers = workers or len(os.sched_getaffinity(0))
    problems: list[str] = []

    def problem(line: str) -> None:
        problems.append(line)
        emit(line)

    headers: list[ShardHeader] = []
    for split in ("train", "val"):
        fmt = split_format(cfg, directory, split)
        for path in split_paths(cfg, directory, split):
            try:
                headers.append(read_header(path, fmt))
            except DataError as exc:
                problem(str(exc))
    todo: list[_Shard] = []
    done: dict[str, dict] = {}
    for h in headers:
        key = _rel(h.path, directory)
        want = info.get(h.path.name, {}).get("blake2b")
        if not _digest_ok(want):
            problem(f"{meta_path}: shard_info[{h.path.name!r}].blake2b = {want!r} is not a hex digest; "
                    "re-create the directory with `recover prepare`")
            want = None
        entry = cache.get(key)
        if _matches(entry, h) and (want is None or len(entry.get("blake2b") or "") == len(want)):
            done[key] = entry
        else:
            todo.append(_Shard(h, key, want))
    total = sum(s.header.size for s in todo)
    columns = (TextColumn("verify"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True,
                  disable=not progress or not todo or not sys.stderr.isatty()) as bar:
        task = bar.add_task("verify", total=total)

        def advance(n: int) -> None:
            bar.update(task, advance=n)

        def chunk(shard: _Shard, k: int, start: int, n: int) -> None:
            shard.chunk_max[k] = _scan_chunk(shard.header, start, n)
            advance(n * shard.header.dtype.itemsize)

        def tasks() -> Iterator[tuple[Callable[..., None], tuple]]:
            for shard in todo:
                if shard.want_digest is not None:
                    yield _scan_hashed, (shard, advance)
                    continue
                spans = list(_chunks(shard.header))
                shard.chunk_max = [-1] * len(spans)
                advance(shard.header.offset)
                for k, (start, n) in enumerate(spans):
                    yield chunk, (shard, k, start, n)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            pending: deque = deque()
            for fn, args in tasks():  # a bounded window of chunks in flight, whatever the size of the data
                pending.append(pool.submit(fn, *args))
                if len(pending) >= 4 * workers:
                    pending.popleft().result()
            for f in pending:
                f.result()
    for shard in todo:
        h = shard.header
        max_id = max(shard.chunk_max, default=-1)
        max_pos = _first(h, lambda a, m=max_id: a == m, shard.chunk_max, max_id)[0] if max_id >= 0 else None
        done[shard.key] = {"size": h.size, "mtime_ns": h.mtime_ns, "fmt": h.fmt, "tokens": h.count,
                           "max_id": max_id, "max_pos": max_pos, "blake2b": shard.digest}
    scan_seconds = time.perf_counter() - t0
    largest = -1
    for h in headers:
        entry = done[_rel(h.path, directory)]
        largest = max(largest, entry["max_id"])
        rec = info.get(h.path.name, {})
        if _int(rec.get("tokens")) is not None and rec["tokens"] != h.count:
            problem(_stale_count(h, rec["tokens"], meta_path))
        elif _int(rec.get("max_id")) is not None and rec["max_id"] != entry["max_id"]:
            problem(f"{h.path}: largest token id {entry['max_id']} but {meta_path} shard_info records "
                    f"{rec['max_id']}: the shard changed after `recover prepare` wrote it; re-create it")
        want = rec.get("blake2b") if _digest_ok(rec.get("blake2b")) else None
        if want is not None and entry.get("blake2b") != want.lower():
            problem(f"{h.path}: checksum mismatch: blake2b {entry.get('blake2b')} but {meta_path} shard_info "
                    f"records {want}: the file changed after `recover prepare` wrote it (a bad copy or disk); "
                    "re-create it with `recover prepare` or copy it again")
        if vocab is not None and entry["max_id"] >= vocab[0]:
            first, count = _first(h, lambda a: a >= vocab[0], count=True)
            bad = int(read_token(h, first))
            problem(f"{h.path}: token id {bad} at position {first} (byte {h.byte_offset(first)}) is out of range "
                    f"for vocab_size {vocab[0]} ({vocab[1]}); {count:,} such id(s) in this shard, the largest "
                    f"{entry['max_id']}; re-prepare with the model's tokenizer or raise model.vocab_size to at "
                    f"least {entry['max_id'] + 1}")
    warning = _write_cache(directory, {_rel(h.path, directory): done[_rel(h.path, directory)] for h in headers})
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return VerifyResult(directory, len(headers), sum(h.count for h in headers), sum(h.size for h in headers),
                        total, len(headers) - len(todo), scan_seconds, largest, vocab, problems, warning)


def read_token(header: ShardHeader, position: int) -> int:
    """One token of a shard."""
    with open(header.path, "rb") as f:
        f.seek(header.byte_offset(position))
        return int(np.frombuffer(f.read(header.dtype.itemsize), dtype=header.dtype)[0])


def _write_cache(directory: Path, entries: dict[str, dict]) -> str | None:
    """Write the cache atomically; the reason it could not be written, or None."""
    path = cache_path(directory)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "shards": entries}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return (f"could not record the result in {path} ({exc.strerror or exc}); the next --verify reads every "
                "shard again and launch cannot use it")
    return None


def shard_windows(ds: TokenDataset, seq_len: int) -> np.ndarray:
    """The windows of ``seq_len + 1`` tokens in each shard of ``ds`` (neighbours share a token)."""
    return np.array([max(0, (n - 1) // seq_len) for n in ds.lengths], dtype=np.int64)


def check_windows(datasets: Sequence[TokenDataset], seq_len: int, microbatch_size: int, split: str) -> None:
    """Raises DataError unless the ``split`` (``train`` or ``val``) of ``datasets`` holds at least one
    microbatch of windows: an empty split is named as such, a short one with its counts and the fixes."""
    count = sum(int(shard_windows(ds, seq_len).sum()) for ds in datasets)
    if count >= microbatch_size:
        return
    names = ", ".join(ds.source for ds in datasets)
    tokens = sum(ds.num_tokens for ds in datasets)
    shards = sum(len(ds.lengths) for ds in datasets)
    if tokens == 0:
        kind = "training" if split == "train" else "validation"
        raise DataError(f"{names}: the {kind} split is empty (0 tokens in {shards} shard(s)); give it data "
                        f"(`recover prepare` writes both splits) or name other shards with {SPLIT_OPTION[split]}")
    raise DataError(f"{names}: {tokens} tokens in {shards} shard(s) give only {count} windows of "
                    f"seq_len+1={seq_len + 1} tokens, fewer than microbatch_size={microbatch_size}; use a "
                    "shorter seq_len, a smaller microbatch or more data")


def check_data(cfg: DataConfig, data_dir: Path, vocab_size: int,
               hint: Callable[[str], None] | None = None) -> tuple[TokenDataset, TokenDataset]:
    """Opens the training and validation shards (of the directory's layout, or ``cfg``'s patterns) and
    checks what can be checked without reading tokens, so it costs a ``stat`` and a 1 KiB read per shard
    whatever the size of the data: every header (magic, version, size), the data's recorded vocabulary
    against ``vocab_size`` (:func:`recover.data.layout.check_vocab_fits`), and each shard's recorded
    largest token id against ``vocab_size``: from a matching ``recover prepare --verify`` cache, else
    from ``meta.json`` (``shard_info``, or its top-level ``max_id``) (:func:`recorded_maxima`).
    A shard with none of these is not scanned; ``hint``, when given, gets one line saying how to check
    it (training checks each microbatch's ids anyway). Torch-free: ``recover launch`` runs it before it
    starts any process, and every rank again when it opens its samplers.

    Raises:
        DataError: missing splits (naming what was looked for and the options), a vocabulary smaller
            than the data's, the first bad shard header, a training split that does not fill a
            microbatch (:func:`check_windows`; the validation split's, over every source, is the
            caller's), or a recorded id beyond ``vocab_size``, named, with the problem and the fix.
    """
    with one_listing():  # the directory is read once, however often its layout is asked about
        check_vocab_fits(vocab_size, data_vocab(cfg, data_dir))
        for split in ("train", "val"):
            split_paths(cfg, data_dir, split)  # none: one line naming what was looked for and the option
        train, val = (TokenDataset(str(data_dir / split_pattern(cfg, data_dir, split)),
                                   fmt=split_format(cfg, data_dir, split)) for split in ("train", "val"))
    check_windows([train], cfg.seq_len, cfg.microbatch_size, "train")
    unknown = 0
    for ds in (train, val):
        for i, rec in enumerate(recorded_maxima(ds, data_dir)):
            if rec is None:
                unknown += 1
            elif rec.max_id >= vocab_size:
                where = (f"at position {rec.position} (byte {ds.headers[i].byte_offset(rec.position)})"
                         if rec.position is not None else "")
                path = data_dir / META_NAME if rec.whole else ds.paths[i]  # which shard holds it is not recorded
                raise vocab_error(path, rec.max_id, vocab_size, f"{where} ({rec.source})".strip())
    if unknown and hint is not None:
        total = len(train.paths) + len(val.paths)
        hint(f"{unknown} of {total} shard(s) in {data_dir} have no recorded largest token id, so their ids were "
             f"not checked at launch; `recover prepare --verify {data_dir}` checks every token once (training "
             "checks each microbatch's ids anyway)")
    return train, val
