"""``recover export``: a checkpoint as a Hugging Face directory or a plain torch state dict.

Contract:
- :func:`export` reads one complete, verified checkpoint (a RUN_DIR means its newest intact one)
  and needs nothing else: the model and run config and the tokenizer come from the checkpoint
  (:mod:`recover.train.checkpoints.describe`).
- ``hf`` (an architecture whose spec has a Hugging Face mapping; Llama's: :mod:`recover.model.llama.hf`):
  ``config.json`` (:func:`recover.model.hf.hf_config`), ``generation_config.json``,
  ``model.safetensors`` (float32, HF names and layouts; for Llama ``wq``/``wk`` rows in HF's rotary
  layout and no ``lm_head.weight`` when tied) and tokenizer files that ``AutoTokenizer.from_pretrained`` loads:
  the run's ``tokenizer.json``, or for recover's byte tokenizer an equivalent one
  (:func:`recover.model.hf.byte_tokenizer_json`), with ``tokenizer_config.json``
  (``PreTrainedTokenizerFast``). ``LlamaForCausalLM`` then computes recover's logits. An architecture
  without a mapping is refused before anything is written.
- ``torch``: ``model.pt`` = ``{"state_dict", "model_config", "config", "tokenizer", "step",
  "source"}`` (recover's names: ``construct(ModelConfig(**model_config)).load_state_dict``
  takes it, :func:`recover.model.build.construct`), plus the run's ``tokenizer.json`` when it has one.
- Atomic: everything is written into a temporary sibling of ``out`` and renamed into place last, so
  ``out`` never holds half an export. A non-empty ``out`` is refused unless ``overwrite`` (then the
  old one is replaced only once the new one is complete).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from recover.config import ModelConfig
from recover.data.tokenizer import ByteTokenizer, HFTokenizer
from recover.errors import ConfigError
from recover.model import hf

FORMATS = ("hf", "torch")


def export(source: str | Path, fmt: str, out: str | Path, overwrite: bool = False,
           tokenizer: str | None = None) -> Path:
    """Writes the checkpoint ``source`` names into ``out`` in format ``fmt``; returns the checkpoint used.

    Args:
        tokenizer: a tokenizer spec that replaces the checkpoint's own (needed for checkpoints that
            do not record theirs).
    Raises:
        RecoverError: a bad format or ``out``, no intact checkpoint, no tokenizer for ``hf``, or ``hf`` for an
            architecture without a Hugging Face mapping.
    """
    from recover.train.checkpoints.describe import read_description, resolve_checkpoint
    from recover.train.checkpoints.weights import read_checkpoint_state

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not allowed: one of {', '.join(FORMATS)}")
    out = Path(out)
    check_out(out, overwrite)
    ckpt = resolve_checkpoint(source)
    desc = read_description(ckpt)
    if fmt == "hf":
        hf.mapping(desc.model)  # refused before anything is read or written
    tok = desc.tokenizer(tokenizer) if fmt == "hf" or tokenizer or desc.tokenizer_record else None
    state = read_checkpoint_state(ckpt)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "hf":
            _write_hf(tmp, state, desc.model, tok)
        else:
            payload = {"state_dict": state, "model_config": asdict(desc.model), "config": desc.config,
                       "tokenizer": desc.tokenizer_record if not tokenizer else {"spec": tokenizer},
                       "step": desc.step, "source": str(ckpt)}
            torch.save(payload, tmp / "model.pt")
            if isinstance(tok, HFTokenizer):
                shutil.copyfile(tok.path, tmp / "tokenizer.json")
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ckpt


def check_out(out: Path, overwrite: bool) -> None:
    """Refuses an ``out`` that is a file, or a non-empty directory without ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out} is not empty; choose a new directory or replace it with --overwrite")


def _move_into_place(tmp: Path, out: Path) -> None:
    aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    if out.exists():
        os.replace(out, aside)
    os.replace(tmp, out)
    shutil.rmtree(aside, ignore_errors=True)


def _write_hf(tmp: Path, state: dict[str, torch.Tensor], model: ModelConfig,
              tok: ByteTokenizer | HFTokenizer | None) -> None:
    from recover.train.checkpoints.weights import require_safetensors

    safetensors = require_safetensors()
    eot = tok.eot_id if tok is not None else None
    _write_json(tmp / "config.json", hf.hf_config(model, eot))
    _write_json(tmp / "generation_config.json", {"bos_token_id": None, "eos_token_id": eot, "pad_token_id": eot})
    tensors = {k: v.float().contiguous() for k, v in hf.to_hf(state, model).items()}
    safetensors.torch.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)  # as umask says, not 0600
    _write_tokenizer(tmp, tok, model.max_seq_len)


def _write_tokenizer(tmp: Path, tok: ByteTokenizer | HFTokenizer | None, max_len: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for ``AutoTokenizer``."""
    assert tok is not None
    if isinstance(tok, ByteTokenizer):
        _write_json(tmp / "tokenizer.json", hf.byte_tokenizer_json(tok.eot_id))
        eos, literal = hf.EOT_TOKEN, True  # recover's byte tokenizer reads "<|endoftext|>" in text as bytes
    else:
        shutil.copyfile(tok.path, tmp / "tokenizer.json")
        eos = tok.id_to_token(tok.eot_id) if tok.eot_id is not None else None
        literal = False  # as `recover prepare` encoded the data: special tokens in text are special
    _write_json(tmp / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "eos_token": eos,
        "bos_token": None, "unk_token": None, "pad_token": None, "clean_up_tokenization_spaces": False,
        "split_special_tokens": literal})
    _write_json(tmp / "special_tokens_map.json", {"eos_token": eos} if eos else {})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
