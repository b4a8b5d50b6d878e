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

:func:`read_shard` returns a read-only ``np.memmap`` (no copy); :func:`write_shard` writes atomically
(temporary file, then rename), so a crash never leaves a half-written shard under the final name.
:class:`TokenDataset` opens a file, a directory (all ``*.bin``, sorted) or a glob, and checks token
ids against a model's vocabulary; :func:`check_data` does all of it for a run's splits (found by
:mod:`recover.data.layout`: recover's, nanoGPT's or llm.c's names), without torch, so ``recover
launch`` refuses bad data before it starts anything. Every bad input raises
:class:`~recover.errors.DataError` naming the file, the problem and the fix.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recover.errors import DataError

if TYPE_CHECKING:
    from recover.config import DataConfig

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
META_NAME = "meta.json"


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


def _read_header(path: Path) -> np.ndarray | None:
    """The first 256 int32 of ``path``, or None if the file is shorter than a header."""
    if path.stat().st_size < HEADER_BYTES:
        return None
    return np.fromfile(path, dtype="<i4", count=HEADER_INTS)


def detect_format(path: str | Path) -> str:
    """``"llmc"`` if the first int32 of ``path`` is a known llm.c magic (even in a file cut shorter than
    the header), else ``"nanogpt"``.

    Raises:
        DataError: the magic is unknown but the rest is an llm.c header (a known version followed by
            zeros, or a token count that matches the file size): a damaged header, not raw tokens.
    """
    path = Path(path)
    with open(path, "rb") as f:
        first = f.read(4)
    if len(first) == 4 and int(np.frombuffer(first, dtype="<i4")[0]) in LLMC_FLAVOURS:
        return "llmc"
    header = _read_header(path)
    if header is not None:
        magic, version, count = (int(x) for x in header[:3])
        versions = {v for v, _ in LLMC_FLAVOURS.values()}
        sizes = {HEADER_BYTES + count * np.dtype(d).itemsize for _, d in LLMC_FLAVOURS.values()}
        if (version in versions and not header[3:].any()) or (count > 0 and path.stat().st_size in sizes):
            known = ", ".join(str(m) for m in LLMC_FLAVOURS)
            raise DataError(f"{path}: damaged llm.c header: magic {magic} is not one of {known}, but the rest "
                            f"is an llm.c header (version {version}, {count} tokens); re-create the shard with "
                            "`recover prepare` or re-download it")
    return "nanogpt"


def _memmap(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map zero bytes
        empty = np.empty(0, dtype=dtype)
        empty.setflags(write=False)
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def _read_llmc(path: Path) -> np.ndarray:
    size = path.stat().st_size
    header = _read_header(path)
    if header is None:
        raise DataError(
            f"{path}: truncated llm.c shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
            "re-create it with `recover prepare`"
        )
    magic, version, count = (int(x) for x in header[:3])
    if magic not in LLMC_FLAVOURS:
        known = ", ".join(str(m) for m in LLMC_FLAVOURS)
        raise DataError(
            f"{path}: not an llm.c shard: unknown magic {magic} (expected one of {known}); "
            "if it is a raw uint16 nanoGPT file, pass fmt='nanogpt' (or 'auto')"
        )
    want_version, dtype = LLMC_FLAVOURS[magic]
    if version != want_version:
        raise DataError(
            f"{path}: unsupported llm.c version {version} for magic {magic} (expected {want_version}); "
            "re-create the shard with `recover prepare`"
        )
    itemsize = np.dtype(dtype).itemsize
    expected = HEADER_BYTES + count * itemsize
    if size != expected:
        kind = "truncated" if size < expected else "oversized"
        held = (size - HEADER_BYTES) // itemsize
        raise DataError(
            f"{path}: {kind} llm.c shard: header says {count} tokens ({expected} bytes) but the file "
            f"holds {held} tokens ({size} bytes); re-create it with `recover prepare` or re-download it"
        )
    return _memmap(path, np.dtype(dtype).newbyteorder("<"), HEADER_BYTES, count)


def _read_nanogpt(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size % 2:
        raise DataError(
            f"{path}: truncated nanoGPT shard: {size} bytes is odd, but uint16 tokens take 2 bytes each; "
            "re-create it with `recover prepare` or re-download it"
        )
    return _memmap(path, np.dtype("<u2"), 0, size // 2)


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
    path = Path(path)
    _check_fmt(fmt)
    if not path.is_file():
        raise DataError(f"{path}: no such shard file; run `recover prepare --out DIR` first")
    if fmt == "auto":
        fmt = detect_format(path)
    return _read_llmc(path) if fmt == "llmc" else _read_nanogpt(path)


def resolve_shards(source: str | Path) -> list[Path]:
    """The shard files named by ``source``: a file, a directory (its ``*.bin``, sorted) or a glob.

    Raises:
        DataError: nothing matches.
    """
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        paths = sorted(p for p in path.glob("*.bin") if p.is_file())
        pattern = str(path / "*.bin")
    else:
        pattern = str(source)
        paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
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
    """A read-only view of token shards.

    Attributes:
        source: what was asked for (file, directory or glob).
        paths: the shard files, sorted.
        shards: one read-only memmap per path.
        lengths: tokens per shard.
        num_tokens: the total number of tokens.
        meta: the ``meta.json`` next to the shards (written by ``recover prepare``) or None.
    """

    def __init__(self, source: str | Path, fmt: str = "auto") -> None:
        _check_fmt(fmt)
        self.source = str(source)
        self.fmt = fmt
        self.paths = resolve_shards(source)
        self.shards = [read_shard(p, fmt) for p in self.paths]
        self.lengths = [len(s) for s in self.shards]
        self.num_tokens = int(sum(self.lengths))
        self.meta = load_meta(self.paths[0].parent)
        self._shard_max: list[int] | None = None

    @classmethod
    def from_split(cls, directory: str | Path, split: str, fmt: str = "auto") -> TokenDataset:
        """The ``train`` or ``val`` shards of a directory in any layout (:mod:`recover.data.layout`)."""
        from recover.data.layout import detect_split

        return cls(Path(directory) / detect_split(directory, split).pattern(split), fmt)

    def __len__(self) -> int:
        return self.num_tokens

    def shard(self, i: int) -> np.ndarray:
        """The tokens of shard ``i`` (a read-only memory map)."""
        return self.shards[i]

    def __repr__(self) -> str:
        return f"TokenDataset({self.source!r}, shards={len(self.paths)}, tokens={self.num_tokens})"

    def _shard_maxima(self) -> list[int]:
        if self._shard_max is None:
            self._shard_max = [int(s.max()) if len(s) else -1 for s in self.shards]
        return self._shard_max

    def max_token_id(self) -> int:
        """The largest token id in any shard (-1 if there are no tokens); computed once."""
        return max(self._shard_maxima())

    def out_of_range(self, shard: int, offset: int, token_id: int, vocab_size: int) -> DataError:
        """The error for ``token_id`` (``>= vocab_size``) met at token ``offset`` of shard ``shard``."""
        return DataError(f"{self.paths[shard]}: token id {token_id} at position {offset} is out of range for "
                         f"vocab_size {vocab_size}; re-prepare with the model's tokenizer or raise "
                         f"model.vocab_size to at least {token_id + 1}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise DataError if any token id is >= ``vocab_size`` (naming file, id and position)."""
        for path, shard, shard_max in zip(self.paths, self.shards, self._shard_maxima(), strict=True):
            if shard_max < vocab_size:
                continue
            pos = int(np.argmax(shard >= vocab_size))
            raise DataError(
                f"{path}: token id {int(shard[pos])} at position {pos} is out of range for "
                f"vocab_size {vocab_size} (largest id in the dataset: {self.max_token_id()}); "
                "re-prepare with the model's tokenizer or raise model.vocab_size to at least "
                f"{self.max_token_id() + 1}"
            )


def check_data(cfg: DataConfig, data_dir: Path, vocab_size: int) -> tuple[TokenDataset, TokenDataset]:
    """Opens the training and validation shards (of the directory's layout, or ``cfg``'s patterns) and
    checks every one: header (magic, version, size) and every token id against ``vocab_size``, which
    must also cover the data's recorded vocabulary (:func:`recover.data.layout.check_vocab_fits`).
    Torch-free: ``recover launch`` runs it before it starts any process.

    Raises:
        DataError: missing splits (naming what was looked for and the options), a vocabulary smaller
            than the data's, or the first bad shard, named, with the problem and the fix.
    """
    from recover.data.layout import check_vocab_fits, data_vocab, split_format, split_paths, split_pattern

    check_vocab_fits(vocab_size, data_vocab(cfg, data_dir))
    for split in ("train", "val"):
        split_paths(cfg, data_dir, split)  # none: one line naming what was looked for and the option
    train, val = (TokenDataset(str(data_dir / split_pattern(cfg, data_dir, split)),
                               fmt=split_format(cfg, data_dir, split)) for split in ("train", "val"))
    for ds in (train, val):
        ds.check_vocab(vocab_size)
    return train, val
