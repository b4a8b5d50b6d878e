"""Writing a split of tokens to disk in the format its reader expects (used by ``recover prepare``).

Contract:
    * :class:`ShardWriter` (llm.c): shards ``{split}_NNNNNN.bin`` of exactly ``shard_tokens`` tokens,
      the remainder appended to the last one, so no shard is shorter than ``shard_tokens`` unless the
      whole split is: llm.c's loaders (C and Python) refuse a shard with fewer than
      ``processes x B x T + 1`` tokens, so a corpus whose full shards they accept, they accept whole.
      Each shard is first written in the width of its own largest id; :func:`one_flavour` then makes
      the corpus agree: uint16 (magic 20240520, the one llm.c's C loader reads) when every id written
      is below 65,536, else uint32 (20240801) for every shard.
    * :class:`NanoGPTWriter`: nanoGPT's single ``{split}.bin`` of raw uint16 ids, streamed to a hidden
      file and renamed when complete; an id >= 65,536 is refused. :func:`write_meta_pkl` writes the
      ``meta.pkl`` its ``train.py`` reads (``vocab_size``).
    * Every file appears under its final name only when complete (temporary file, then rename).
    * Both record, per file written, ``info[name] = {"tokens", "max_id", "blake2b"}``: its token count,
      largest id (-1 when empty) and :func:`file_blake2b` of its bytes as written. A writer can start
      from shards already on disk (``done``, their names and infos in order): ``recover prepare``'s
      resume after a crash.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np

from recover.data.layout import META_PKL
from recover.data.shards import GPT2_MAGIC, UINT16_LIMIT, read_shard, write_shard
from recover.errors import DataError

BLAKE2B_DIGEST_BYTES = 32


def file_blake2b(path: Path) -> str:
    """Hex BLAKE2b (32-byte digest) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.blake2b(digest_size=BLAKE2B_DIGEST_BYTES)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _max_id(tokens: np.ndarray) -> int:
    return int(tokens.max()) if len(tokens) else -1


class ShardWriter:
    """Writes one split in llm.c's format: shards of exactly ``shard_tokens``, the remainder appended to
    the last one (see the module docstring); each in the width of its own largest id (:func:`one_flavour`
    makes the corpus agree afterwards)."""

    def __init__(
        self, out_dir: Path, split: str, shard_tokens: int, done: list[tuple[str, dict]] | tuple = ()
    ) -> None:
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.names = [name for name, _ in done]
        self.info = {name: dict(info) for name, info in done}
        self.tokens = sum(info["tokens"] for _, info in done)

    def add(self, tokens: np.ndarray) -> None:
        self.buffer.append(tokens)
        self.buffered += len(tokens)
        self.tokens += len(tokens)
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _flush(self, n: int) -> None:
        data = self.buffer[0] if len(self.buffer) == 1 else np.concatenate(self.buffer)
        name = f"{self.split}_{len(self.names):06d}.bin"
        self._write(name, data[:n])
        self.names.append(name)
        self.buffer = [data[n:]] if len(data) > n else []
        self.buffered = len(data) - n

    def close(self) -> None:
        if not self.names:
            self._flush(self.buffered)
        elif self.buffered:  # a short tail: appended to the last full shard
            last = self.names[-1]
            tail = self.buffer[0] if len(self.buffer) == 1 else np.concatenate(self.buffer)
            self._write(last, np.concatenate([np.asarray(read_shard(self.out_dir / last, "llmc")), tail]))
            self.buffer, self.buffered = [], 0

    def _write(self, name: str, tokens: np.ndarray) -> None:
        path = write_shard(self.out_dir / name, tokens, "llmc")
        self.info[name] = {"tokens": len(tokens), "max_id": _max_id(tokens), "blake2b": file_blake2b(path)}


class NanoGPTWriter:
    """Writes one split as nanoGPT's single raw-uint16 ``{split}.bin``, streamed to a hidden file and
    renamed when complete."""

    def __init__(self, out_dir: Path, split: str) -> None:
        self.path = out_dir / f"{split}.bin"
        self.tmp = out_dir / f".{split}.bin.tmp{os.getpid()}"
        self.file = open(self.tmp, "wb")
        self.names = [self.path.name]
        self.info: dict[str, dict] = {}  # filled by close()
        self.tokens = 0
        self.max_id = -1
        self.digest = hashlib.blake2b(digest_size=BLAKE2B_DIGEST_BYTES)

    def add(self, tokens: np.ndarray) -> None:
        if len(tokens) and int(tokens.max()) >= UINT16_LIMIT:
            self.file.close()
            self.tmp.unlink(missing_ok=True)
            raise DataError(f"token id {int(tokens.max())} does not fit nanoGPT's uint16 train.bin/val.bin "
                            "(ids < 65536); use --format llmc")
        data = tokens.astype("<u2", copy=False).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.tokens += len(tokens)
        self.max_id = max(self.max_id, _max_id(tokens))

    def close(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)
        self.info[self.path.name] = {"tokens": self.tokens, "max_id": self.max_id, "blake2b": self.digest.hexdigest()}


def one_flavour(out_dir: Path, names: list[str]) -> list[str]:
    """Rewrites uint16 llm.c shards as uint32 when another shard of the corpus needed uint32; returns
    the names rewritten."""
    magics = {name: int(np.fromfile(out_dir / name, dtype="<i4", count=1)[0]) for name in names}
    if set(magics.values()) == {GPT2_MAGIC} or GPT2_MAGIC not in magics.values():
        return []
    rewritten = [name for name, magic in magics.items() if magic == GPT2_MAGIC]
    for name in rewritten:
        tokens = np.asarray(read_shard(out_dir / name, "llmc"))
        write_shard(out_dir / name, tokens, "llmc", vocab_size=UINT16_LIMIT + 1)
    return rewritten


def write_meta_pkl(out_dir: Path, vocab_size: int) -> None:
    """nanoGPT's ``meta.pkl``: what its ``train.py`` reads (``vocab_size``)."""
    tmp = out_dir / f".{META_PKL}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"vocab_size": int(vocab_size)}, f)
    os.replace(tmp, out_dir / META_PKL)
