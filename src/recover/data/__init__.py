"""Data layer: token shards (nanoGPT and llm.c ``.bin``), tokenizers, ``recover prepare``, the
deterministic sampler that maps ``(seed, step, microbatch_id)`` to token ids, and :func:`indexed`, the
same for any map-style dataset.

Names are imported lazily, so ``import recover.data`` (and ``recover --help``) stays cheap: torch is
loaded only when :class:`Sampler` or :class:`EvalSampler` is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DataError": "recover.errors",
    "TokenDataset": "recover.data.shards",
    "read_shard": "recover.data.shards",
    "write_shard": "recover.data.shards",
    "detect_format": "recover.data.shards",
    "ByteTokenizer": "recover.data.tokenizer",
    "HFTokenizer": "recover.data.tokenizer",
    "load_tokenizer": "recover.data.tokenizer",
    "prepare_files": "recover.data.prepare",
    "prepare_builtin": "recover.data.prepare",
    "Sampler": "recover.data.sampler",
    "EvalSampler": "recover.data.sampler",
    "tokens": "recover.data.sampler",
    "indexed": "recover.data.indexed",
}

__all__ = [
    "ByteTokenizer",
    "DataError",
    "EvalSampler",
    "HFTokenizer",
    "Sampler",
    "TokenDataset",
    "detect_format",
    "indexed",
    "load_tokenizer",
    "prepare_builtin",
    "prepare_files",
    "read_shard",
    "tokens",
    "write_shard",
]

if TYPE_CHECKING:
    from recover.data.indexed import indexed
    from recover.data.prepare import prepare_builtin, prepare_files
    from recover.data.sampler import EvalSampler, Sampler, tokens
    from recover.data.shards import TokenDataset, detect_format, read_shard, write_shard
    from recover.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
    from recover.errors import DataError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recover.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
