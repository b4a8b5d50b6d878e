"""Hugging Face files of any registered architecture: its mapping looked up by ``model.arch`` or
``model_type``, and the byte tokenizer as a ``tokenizer.json``.

Pure conversions (no files): :mod:`recover.train.checkpoints.export` writes what they return and
:mod:`recover.train.checkpoints.weights` reads a Hugging Face directory through them.

Contract:
- :func:`to_hf`, :func:`from_hf`, :func:`recover_name` and :func:`hf_config` are the
  :class:`~recover.model.spec.HFMapping` of ``cfg.arch`` (Llama's: :mod:`recover.model.llama.hf`);
  an architecture without one is refused with a ConfigError naming ``--format torch``.
- :func:`model_config_from_hf` picks the architecture whose mapping has the ``config.json``'s
  ``model_type``, and reads the config with it.
- :func:`byte_tokenizer_json` is a ``tokenizer.json`` (HF ``tokenizers`` format) that encodes and
  decodes exactly as recover's :class:`~recover.data.tokenizer.ByteTokenizer`: a BPE model with no
  merges over the 256 byte symbols of the byte-level alphabet, id ``b`` for byte ``b``, and the
  end-of-text token at 256.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recover.errors import ConfigError
from recover.model import spec as registry

if TYPE_CHECKING:
    import torch

    from recover.model.spec import HFMapping, ModelConfig

EOT_TOKEN = "<|endoftext|>"


def mapping(cfg: ModelConfig) -> HFMapping:
    """The Hugging Face mapping of ``cfg.arch``.

    Raises:
        ConfigError: the architecture has none.
    """
    found = registry.get(cfg.arch).hf
    if found is None:
        raise ConfigError(f"model.arch = {cfg.arch!r} has no Hugging Face mapping: export it with --format torch, "
                          "or give its ModelSpec an hf mapping")
    return found


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A recover state dict (whole tensors) in HF's names and layouts."""
    return mapping(cfg).to_hf(state, cfg)


def from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF state dict in recover's names and layouts (``cfg``: the HF model's shape)."""
    return mapping(cfg).from_hf(state, cfg)


def recover_name(name: str, cfg: ModelConfig) -> str | None:
    """recover's name of the HF tensor ``name``; None for a buffer to skip; KeyError when it has no place."""
    return mapping(cfg).recover_name(name)


def hf_config(cfg: ModelConfig, eot_id: int | None, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` of the HF model that computes what recover's model computes."""
    return mapping(cfg).config(cfg, eot_id, dtype)


def model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The recover model of an HF ``config.json`` (``where`` names it in errors).

    Raises:
        ConfigError: no registered architecture has this ``model_type``, or its mapping refuses the config.
    """
    kind = hf.get("model_type")
    by_type = {}
    for name in registry.names():
        found = registry.get(name).hf
        if found is not None:
            by_type[found.model_type] = found
    if kind not in by_type:
        known = " or ".join(f"model_type {t!r}" for t in sorted(by_type))
        raise ConfigError(f"{where}: model_type {kind!r} is not supported; --init-from takes a Hugging Face model of "
                          f"{known} or a recover checkpoint")
    return by_type[kind].config_from_hf(hf, where)


def byte_symbols() -> list[str]:
    """The byte-level alphabet: byte ``b`` as one printable character (printable Latin-1 bytes as
    themselves, the other 68 as the characters from U+0100 on, in byte order)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, extra = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(0x100 + extra))
            extra += 1
    return symbols


def byte_tokenizer_json(eot_id: int = 256) -> dict[str, Any]:
    """A ``tokenizer.json`` equivalent to recover's byte tokenizer (ids 0..255 = bytes, ``eot_id`` = end of text)."""
    vocab = {s: b for b, s in enumerate(byte_symbols())}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": eot_id, "content": EOT_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
