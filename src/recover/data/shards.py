"""Token shards on disk, in the two formats people already have.

Contract:
    * **nanoGPT** (``fmt="nanogpt"``): raw little-endian ``uint16`` token ids, no header. A file
      with an odd number of bytes is truncated and refused.
    * **llm.c** (``fmt="llmc"``): a header of 256 little-endian ``int32`` (``[0]`` magic, ``[1]``
      version, ``[2]`` token count), then the tokens. Two flavours:
      GPT-2 (magic 20240520, version 1, ``uint16`` tokens) and Llama-3 (magic 20240801, version 7,
      ``uint32`` tokens). A file whose size disagrees with its header is refused.
    * ``fmt="auto"`` reads a file as llm.c when its first ``int32`` is a known magic (a file cut
      shorter than the header included), else as nanoGPT; an unknown magic in front of the rest of
      an llm.c header is a damaged header, refused as such (never read as raw tokens, which would
      be reported as a vocabulary problem).

:func:`read_header` checks a shard from its size and first 1 KiB (no token read); :func:`read_shard`
returns a read-only ``np.memmap`` (no copy); :func:`write_shard` writes atomically (temporary file, then
rename), so a crash never leaves a half-written shard under the final name. :class:`TokenDataset` opens
a file, a directory (all ``*.bin``, sorted) or a glob lazily: headers at construction, a bounded LRU of
memory maps after (so start-up, memory and file descriptors do not grow with the data); training reads
windows with ``pread`` (:meth:`TokenDataset.read`), so a shard cut short under a running job is a
``DataError`` naming it, never a SIGBUS.
Start-up checks of a run's splits without reading tokens are :func:`recover.data.verify.check_data`'s
(splits found by :mod:`recover.data.layout`). Every bad input raises
:class:`~recover.errors.DataError` naming the file, the problem and the fix.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import mmap
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import numpy as np

from recover.errors import DataError

FORMATS = ("auto", "llmc", "nanogpt")
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
GPT2_MAGIC, GPT2_VERSION = 20240520, 1
LLAMA3_MAGIC, LLAMA3_VERSION = 20240801, 7
# magic -> (version, token dtype)
LLMC_FLAVOURS: dict[int, tuple[int, type[np.unsignedinteger]]] = {
    GPT2_MAGIC: (GPT2_VERSION, np.uint16),
    LLAMA3_MAGIC: (LLAMA3_VERSION, np.uint32),
}
UINT16_LIMIT = 1 << 16
_LE_DTYPES = {**{m: np.dtype(d).newbyteorder("<") for m, (_, d) in LLMC_FLAVOURS.items()}, None: np.dtype("<u2")}
META_NAME = "meta.json"
MAX_OPEN = 64  # memory maps (file descriptors) a TokenDataset keeps open


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise DataError(f"unknown shard format {fmt!r}; use one of {', '.join(FORMATS)}")


def _as_token_array(path: Path, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as an integer array; refuses negative ids and non-integer data."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return arr.astype(np.uint16)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: tokens must be a 1-D sequence of integers, got {arr.dtype} {arr.shape}")
    if int(arr.min()) < 0:
        raise DataError(f"{path}: negative token id {int(arr.min())}; token ids must be >= 0")
    return arr


def _atomic_write(path: Path, chunks: Sequence[bytes | np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk.tobytes() if isinstance(chunk, np.ndarray) else chunk)
    os.replace(tmp, path)


def write_shard(
    path: str | Path,
    tokens: Sequence[int] | np.ndarray,
    fmt: str = "llmc",
    *,
    vocab_size: int | None = None,
) -> Path:
    """Write ``tokens`` to ``path`` as one shard.

    Args:
        path: destination file (parent directory must exist).
        tokens: 1-D non-negative integer token ids.
        fmt: ``"llmc"`` or ``"nanogpt"``.
        vocab_size: for llm.c, choose the token width from the vocabulary instead of from this
            shard's largest id, so every shard of a corpus has the same flavour.

    Returns:
        The path written.

    Raises:
        DataError: bad format, negative ids, or an id >= 65536 for nanoGPT.
    """
    path = Path(path)
    if fmt not in ("llmc", "nanogpt"):
        raise DataError(f"{path}: cannot write format {fmt!r}; use 'llmc' or 'nanogpt'")
    arr = _as_token_array(path, tokens)
    max_id = int(arr.max()) if arr.size else -1
    if fmt == "nanogpt":
        if max_id >= UINT16_LIMIT:
            raise DataError(
                f"{path}: token id {max_id} does not fit the nanoGPT format (uint16, ids < 65536); "
                "write with fmt='llmc' (uint32 tokens) instead"
            )
        _atomic_write(path, [arr.astype("<u2", copy=False)])
        return path
    limit = vocab_size if vocab_size is not None else max_id + 1
    magic = GPT2_MAGIC if max(limit, max_id + 1) <= UINT16_LIMIT else LLAMA3_MAGIC
    version, dtype = LLMC_FLAVOURS[magic]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, arr.size)
    _atomic_write(path, [header, arr.astype(np.dtype(dtype).newbyteorder("<"), copy=False)])
    return path


@dataclass(frozen=True)
class ShardHeader:
    """What one shard's header and size say, read without touching its tokens."""

    path: Path
    fmt: str
    """``"llmc"`` or ``"nanogpt"`` (never ``"auto"``)."""
    dtype: np.dtype
    """Little-endian ``uint16`` or ``uint32``."""
    offset: int
    """Bytes before the first token (1024 for llm.c, 0 for nanoGPT)."""
    count: int
    """Tokens in the file."""
    size: int
    """File size in bytes, when the header was read."""
    mtime_ns: int
    """Modification time, when the header was read."""

    def byte_offset(self, position: int) -> int:
        """Where token ``position`` starts in the file."""
        return self.offset + position * self.dtype.itemsize


def _detect(path: Path, head: bytes, size: int) -> str:
    """:func:`detect_format` on the file's first bytes (up to a header) and its size."""
    if len(head) >= 4 and int(np.frombuffer(head[:4], dtype="<i4")[0]) in LLMC_FLAVOURS:
        return "llmc"
    if len(head) == HEADER_BYTES:
        header = np.frombuffer(head, dtype="<i4")
        magic, version, count = (int(x) for x in header[:3])
        versions = {v for v, _ in LLMC_FLAVOURS.values()}
        sizes = {HEADER_BYTES + count * np.dtype(d).itemsize for _, d in LLMC_FLAVOURS.values()}
        if (version in versions and not header[3:].any()) or (count > 0 and size in sizes):
            known = ", ".join(str(m) for m in LLMC_FLAVOURS)
            raise DataError(f"{path}: damaged llm.c header: magic {magic} is not one of {known}, but the rest "
                            f"is an llm.c header (version {version}, {count} tokens); re-create the shard with "
                            "`recover prepare` or re-download it")
    return "nanogpt"


def detect_format(path: str | Path) -> str:
    """``"llmc"`` if the first int32 of ``path`` is a known llm.c magic (even in a file cut shorter than
    the header), else ``"nanogpt"``.

    Raises:
        DataError: the magic is unknown but the rest is an llm.c header (a known version followed by
            zeros, or a token count that matches the file size): a damaged header, not raw tokens.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    return _detect(path, head, path.stat().st_size)


def _llmc_header(path: Path, head: bytes, size: int, mtime_ns: int) -> ShardHeader:
    if len(head) < HEADER_BYTES:
        raise DataError(
            f"{path}: truncated llm.c shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
            "re-create it with `recover prepare`"
        )
    magic, version, count = struct.unpack_from("<3i", head)
    if magic not in LLMC_FLAVOURS:
        known = ", ".join(str(m) for m in LLMC_FLAVOURS)
        raise DataError(
            f"{path}: not an llm.c shard: unknown magic {magic} (expected one of {known}); "
            "if it is a raw uint16 nanoGPT file, pass fmt='nanogpt' (or 'auto')"
        )
    want_version = LLMC_FLAVOURS[magic][0]
    if version != want_version:
        raise DataError(
            f"{path}: unsupported llm.c version {version} for magic {magic} (expected {want_version}); "
            "re-create the shard with `recover prepare`"
        )
    itemsize = _LE_DTYPES[magic].itemsize
    expected = HEADER_BYTES + count * itemsize
    if size != expected:
        kind = "truncated" if size < expected else "oversized"
        held = (size - HEADER_BYTES) // itemsize
        raise DataError(
            f"{path}: {kind} llm.c shard: header says {count} tokens ({expected} bytes) but the file "
            f"holds {held} tokens ({size} bytes); re-create it with `recover prepare` or re-download it"
        )
    return ShardHeader(path, "llmc", _LE_DTYPES[magic], HEADER_BYTES, count, size, mtime_ns)


def _nanogpt_header(path: Path, size: int, mtime_ns: int) -> ShardHeader:
    if size % 2:
        raise DataError(
            f"{path}: truncated nanoGPT shard: {size} bytes is odd, but uint16 tokens take 2 bytes each; "
            "re-create it with `recover prepare` or re-download it"
        )
    return ShardHeader(path, "nanogpt", _LE_DTYPES[None], 0, size // 2, size, mtime_ns)


def read_header(path: str | Path, fmt: str = "auto") -> ShardHeader:
    """Check one shard from its size and first 1 KiB (one ``stat``, one read; no token is read).

    Args:
        path: the shard file.
        fmt: ``"auto"``, ``"llmc"`` or ``"nanogpt"``.

    Raises:
        DataError: missing file, unknown or damaged magic, unknown version (llm.c), or a size that
            disagrees with the header (llm.c) or is odd (nanoGPT).
    """
    path = Path(path)
    _check_fmt(fmt)
    try:
        if fmt == "nanogpt":  # no header: the size says it all
            st, head = os.stat(path), b""
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                st, head = os.fstat(fd), os.pread(fd, HEADER_BYTES, 0)
            finally:
                os.close(fd)
        if not S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise DataError(f"{path}: no such shard file; run `recover prepare --out DIR` first") from exc
    except OSError as exc:
        raise DataError(f"{path}: unreadable shard ({exc.strerror or exc}); check its permissions") from exc
    if fmt == "auto":
        fmt = _detect(path, head, st.st_size)
    if fmt == "llmc":
        return _llmc_header(path, head, st.st_size, st.st_mtime_ns)
    return _nanogpt_header(path, st.st_size, st.st_mtime_ns)


def _memmap(header: ShardHeader, random: bool = False) -> np.ndarray:
    """The shard's tokens, memory-mapped. ``random``: tell the kernel the reads jump around (a sampler's
    windows), so a page fault reads that page, not the default read-around of up to megabytes: a cold
    window costs ~60 us instead of ~3 ms (measured on sparse shards, ``recover bench data``)."""
    if header.count == 0:  # mmap cannot map zero bytes
        empty = np.empty(0, dtype=header.dtype)
        empty.setflags(write=False)
        return empty
    arr = np.memmap(header.path, dtype=header.dtype, mode="r", offset=header.offset, shape=(header.count,))
    raw = getattr(arr, "_mmap", None)
    if random and raw is not None and hasattr(mmap, "MADV_RANDOM"):
        raw.madvise(mmap.MADV_RANDOM)
    return arr


def read_shard(path: str | Path, fmt: str = "auto") -> np.ndarray:
    """Open one shard as a read-only memory map (no copy).

    Args:
        path: the shard file.
        fmt: ``"auto"``, ``"llmc"`` or ``"nanogpt"``.

    Returns:
        A 1-D read-only array of token ids (``uint16`` or ``uint32``).

    Raises:
        DataError: missing file, unknown magic/version (llm.c), or a truncated/oversized file.
    """
    return _memmap(read_header(path, fmt))


_listing = threading.local()  # within one_listing(): directory -> its files, (directory, pattern) -> matches


@contextmanager
def one_listing() -> Iterator[None]:
    """Within it, :func:`file_names` reads each directory once and answers each pattern once (the layout
    of a directory is asked about many times while a run's data is checked; a directory of 100k shards
    is then listed once, not dozens of times). Nothing is kept after it."""
    if getattr(_listing, "memo", None) is not None:
        yield
        return
    _listing.memo = {}
    try:
        yield
    finally:
        _listing.memo = None


def _dir_files(directory: str | Path) -> list[str]:
    memo = getattr(_listing, "memo", None)
    key = ("dir", str(directory))
    if memo is not None and key in memo:
        return memo[key]
    try:
        with os.scandir(directory) as entries:
            names = [e.name for e in entries if e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        names = []
    if memo is not None:
        memo[key] = names
    return names


def file_names(directory: str | Path, pattern: str) -> list[str]:
    """The paths, relative to ``directory`` (taken literally), of its files matching the glob ``pattern``,
    sorted, as :func:`glob.glob` finds them (a name with a leading dot only by a pattern with one: no
    ``._train_000000.bin`` left by a copy from macOS). A pattern without a ``/`` costs one ``readdir`` and
    no ``stat``, or nothing within :func:`one_listing` once the directory was read."""
    if "/" in pattern or "**" in pattern:
        return sorted(p for p in glob.glob(pattern, root_dir=directory) if os.path.isfile(os.path.join(directory, p)))
    memo = getattr(_listing, "memo", None)
    key = ("glob", str(directory), pattern)
    if memo is not None and key in memo:
        return list(memo[key])
    match = re.compile(fnmatch.translate(pattern)).match
    hidden_ok = pattern.startswith(".")  # glob's rule: '*' does not match a leading dot
    names = sorted(n for n in _dir_files(directory) if (hidden_ok or not n.startswith(".")) and match(n))
    if memo is not None:
        memo[key] = names
    return list(names)


def list_files(directory: str | Path, pattern: str) -> list[Path]:
    """:func:`file_names` as paths under ``directory``."""
    directory = Path(directory)
    return [directory / name for name in file_names(directory, pattern)]


def resolve_shards(source: str | Path) -> list[Path]:
    """The shard files named by ``source``: a file, a directory (its ``*.bin``, sorted) or a glob.

    Raises:
        DataError: nothing matches.
    """
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        paths = list_files(path, "*.bin")
        pattern = str(path / "*.bin")
    else:
        pattern = str(source)
        parent, name = os.path.split(pattern)
        if re.search(r"[*?\[]", parent):  # magic in the directory part too
            paths = sorted((Path(p) for p in glob.glob(pattern) if Path(p).is_file()), key=str)
        else:
            paths = list_files(parent or ".", name)
    if not paths:
        raise DataError(
            f"no token shards match {pattern!r}; check the path (a data directory's splits are chosen with "
            "--data.train_pattern and --data.val_pattern), or create shards with `recover prepare FILES --out DIR`"
        )
    return paths


def load_meta(directory: Path) -> dict | None:
    """``directory/meta.json`` written by ``recover prepare``, or None if there is none."""
    meta_path = directory / META_NAME
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{meta_path}: unreadable ({exc}); delete it and re-run `recover prepare`") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: expected a JSON object; delete it and re-run `recover prepare`")
    return meta


class TokenDataset:
    """A read-only view of token shards, opened lazily.

    Construction reads each shard's size and header only (:func:`read_header`: one ``stat`` and at
    most 1 KiB per file), so it costs the same for 1M or 10T tokens. :meth:`shard` memory-maps a file
    on first use and keeps the ``max_open`` most recently used maps (each holds a file descriptor),
    so open files and mappings stay bounded whatever the number of shards. Thread-safe; pickles
    without its open maps.

    Attributes:
        source: what was asked for (file, directory or glob).
        paths: the shard files, sorted.
        headers: one :class:`ShardHeader` per path (format, dtype, offset, tokens, size, mtime).
        lengths: tokens per shard.
        num_tokens: the total number of tokens.
        meta: the ``meta.json`` next to the shards (written by ``recover prepare``) or None.
    """

    def __init__(self, source: str | Path, fmt: str = "auto", *, max_open: int = MAX_OPEN) -> None:
        _check_fmt(fmt)
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.source = str(source)
        self.fmt = fmt
        self.max_open = max_open
        self.paths = resolve_shards(source)
        self.headers = [read_header(p, fmt) for p in self.paths]
        self.lengths = [h.count for h in self.headers]
        self.num_tokens = int(sum(self.lengths))
        self.meta = load_meta(self.paths[0].parent)
        self._shard_max: list[int] | None = None
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_tokens

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"], state["_fds"], state["_lock"] = OrderedDict(), OrderedDict(), None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def shard(self, i: int) -> np.ndarray:
        """The tokens of shard ``i`` (a read-only memory map, opened on first use).

        Raises:
            IndexError: no shard ``i``.
            DataError: the file changed size since the dataset read its header.
        """
        i = range(len(self.paths))[i]
        with self._lock:
            arr = self._open.get(i)
            if arr is not None:
                self._open.move_to_end(i)
                return arr
        header = self.headers[i]
        try:
            size = header.path.stat().st_size
        except OSError as exc:
            raise DataError(f"{header.path}: shard vanished after it was opened ({exc.strerror or exc}); the data "
                            "must stay in place during a run") from exc
        if size != header.size:
            raise DataError(f"{header.path}: shard changed on disk after it was opened ({header.size} bytes, now "
                            f"{size}); the data must not change during a run: restart it")
        arr = _memmap(header, random=True)
        with self._lock:
            self._open[i] = arr
            self._open.move_to_end(i)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # its map (and file descriptor) closes with its last reference
        return arr

    def read(self, i: int, start: int, count: int) -> np.ndarray:
        """Tokens ``start .. start + count`` of shard ``i``, read with ``pread`` (a copy), not through a memory
        map: a shard cut short on disk under a running job is then a :class:`~recover.errors.DataError` naming
        it (bad data: the job saves and stops with its line), where a map's read past the new end would
        kill the process with SIGBUS. One descriptor per shard, bounded by ``max_open`` as the maps are.

        Raises:
            DataError: the file vanished or changed size since the dataset read its header.
        """
        header = self.headers[i]
        size = np.dtype(header.dtype).itemsize
        with self._lock:
            fd = self._fd(i)
            try:
                data = os.pread(fd, count * size, header.offset + start * size)
            except OSError as exc:
                raise DataError(f"{header.path}: shard unreadable during the run ({exc.strerror or exc}); the "
                                "data must stay in place during a run: restore it and continue with --resume") from exc
            if len(data) < count * size:
                now = os.fstat(fd).st_size
                raise DataError(f"{header.path}: shard changed on disk during the run ({header.size} bytes when "
                                f"opened, now {now}); the data must not change during a run: restore it and "
                                "continue with --resume")
        return np.frombuffer(data, dtype=header.dtype)

    def _fd(self, i: int) -> int:
        """Shard ``i``'s open descriptor (size checked against its header when opened); the lock is held."""
        fd = self._fds.get(i)
        if fd is not None:
            self._fds.move_to_end(i)
            return fd
        header = self.headers[i]
        try:
            fd = os.open(header.path, os.O_RDONLY)
        except OSError as exc:
            raise DataError(f"{header.path}: shard vanished after it was opened ({exc.strerror or exc}); the data "
                            "must stay in place during a run") from exc
        if os.fstat(fd).st_size != header.size:
            now = os.fstat(fd).st_size
            os.close(fd)
            raise DataError(f"{header.path}: shard changed on disk after it was opened ({header.size} bytes, now "
                            f"{now}); the data must not change during a run: restart it")
        self._fds[i] = fd
        while len(self._fds) > self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def open_shards(self) -> int:
        """How many shards are memory-mapped now (at most ``max_open``)."""
        return len(self._open)

    def __repr__(self) -> str:
        return f"TokenDataset({self.source!r}, shards={len(self.paths)}, tokens={self.num_tokens})"

    def _shard_maxima(self) -> list[int]:
        if self._shard_max is None:
            self._shard_max = [int(self.shard(i).max()) if n else -1 for i, n in enumerate(self.lengths)]
        return self._shard_max

    def max_token_id(self) -> int:
        """The largest token id in any shard (-1 if there are no tokens); reads every token, once."""
        return max(self._shard_maxima())

    def check_vocab(self, vocab_size: int) -> None:
        """Raise DataError if any token id is >= ``vocab_size`` (naming file, id and position).

        Reads every token (once per dataset): for start-up use :func:`recover.data.verify.check_data`, which trusts what
        ``recover prepare`` and ``recover prepare --verify`` recorded instead.
        """
        for i, shard_max in enumerate(self._shard_maxima()):
            if shard_max < vocab_size:
                continue
            shard = self.shard(i)
            pos = int(np.argmax(shard >= vocab_size))
            raise DataError(
                f"{self.paths[i]}: token id {int(shard[pos])} at position {pos} is out of range for "
                f"vocab_size {vocab_size} (largest id in the dataset: {self.max_token_id()}); "
                "re-prepare with the model's tokenizer or raise model.vocab_size to at least "
                f"{self.max_token_id() + 1}"
            )

    def out_of_range(self, shard_index: int, offset: int, token_id: int, vocab_size: int) -> DataError:
        """The error for token id ``token_id`` (>= ``vocab_size``) found at token ``offset`` of shard
        ``shard_index`` (for a caller that checks ids as it reads them, e.g. per microbatch): it names
        the file, the token position and byte offset in the file, the id and the fix. Returned, not raised.
        """
        header = self.headers[shard_index]
        return vocab_error(header.path, token_id, vocab_size,
                           f"at position {offset} (byte {header.byte_offset(offset)})")


def vocab_error(path: Path | str, token_id: int, vocab_size: int, where: str) -> DataError:
    """``{path}: token id X {where} is out of range for vocab_size V; re-prepare ... or raise model.vocab_size``."""
    return DataError(
        f"{path}: token id {token_id} {where} is out of range for vocab_size {vocab_size}; re-prepare with the "
        f"model's tokenizer or raise model.vocab_size to more than {token_id} (`recover prepare --verify DIR` "
        "lists every such id)"
    )
