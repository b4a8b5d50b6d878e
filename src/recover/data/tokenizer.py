"""Tokenizers for ``recover prepare``: a dependency-free byte tokenizer and local HuggingFace ones.

Contract: every tokenizer has ``spec`` (the string that recreates it with :func:`load_tokenizer`),
``vocab_size``, ``eot_id`` (the end-of-text id that separates documents, or None), ``encode(text)``
returning a 1-D numpy array of ids, and ``decode(ids)`` returning a string. Nothing here touches
the network: a HuggingFace tokenizer is read from a local ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from recover.errors import DataError

EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BYTE_SPEC = "byte"


class Tokenizer(Protocol):
    spec: str
    vocab_size: int
    eot_id: int | None

    def encode(self, text: bytes | str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; 256 is end-of-text. Needs nothing, encodes at memory speed."""

    spec = BYTE_SPEC
    vocab_size = 257
    eot_id = 256

    def encode(self, text: bytes | str) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _tokenizer_file(path: Path) -> Path:
    """``path`` itself, or ``path/tokenizer.json`` when given a directory."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"tokenizer {str(path)!r}: no such file; pass 'byte' or the path of a local HuggingFace "
            "tokenizer.json (or a directory that holds one)"
        )
    return file


class HFTokenizer:
    """A local HuggingFace ``tokenizer.json``, loaded with the optional ``tokenizers`` package."""

    def __init__(self, path: str | Path) -> None:
        self.path = _tokenizer_file(Path(path))
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise DataError(
                f"tokenizer {str(self.path)!r} needs the 'tokenizers' package: pip install 'recover-llm[hf]'"
            ) from exc
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise DataError(f"{self.path}: not a valid HuggingFace tokenizer.json ({exc})") from exc
        self.spec = str(self.path.resolve())
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eot_id = self._find_eot()

    def _find_eot(self) -> int | None:
        for name in EOT_NAMES:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        return None

    def encode(self, text: bytes | str) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id`` (None when there is none)."""
        return self._tok.id_to_token(int(token_id))

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` gives :class:`ByteTokenizer`; anything else is a path to a HuggingFace tokenizer.

    Raises:
        DataError: missing file, or the ``tokenizers`` package is not installed.
    """
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    return HFTokenizer(spec)
