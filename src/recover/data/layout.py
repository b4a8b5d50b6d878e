"""What a data directory holds: which files are its train and val splits, and its vocabulary.

Contract:
    * **Layouts** are recognised from the files present, so ``--data.path DIR`` alone is enough:
      recover's own (``train_*.bin`` / ``val_*.bin``, from ``recover prepare --format llmc``),
      nanoGPT's (``train.bin`` / ``val.bin``, as its ``prepare.py`` leaves them, and as
      ``recover prepare --format nanogpt`` writes them) and llm.c's (``*_train*.bin`` /
      ``*_val*.bin``: ``fineweb_train_000001.bin``, ``tiny_shakespeare_val.bin``). Each split is
      detected on its own (nanoGPT's files are read as raw uint16, never sniffed for an llm.c header);
      ``data.train_pattern`` / ``data.val_pattern``, when set, win. A split that
      matches no layout, or several, is refused in one line that lists what was looked for and names
      the options.
    * **The data's vocabulary** (:func:`data_vocab`): a ``builtin:`` corpus's byte tokenizer (257);
      else ``meta.json`` (``recover prepare``); else ``meta.pkl`` (nanoGPT; read without running any
      code: only plain dicts, lists, strings and numbers load); else the convention of the layout:
      nanoGPT's ``train.py`` takes a directory without ``meta.pkl`` for GPT-2 (50,257 ids) and an
      llm.c header's magic names its tokenizer (20240520: GPT-2, 50,257; 20240801: Llama 3, 128,256).
      recover's own layout without ``meta.json`` has no known vocabulary (None).
    * **The model's vocabulary** (:func:`model_vocab`): ``--model.vocab_size`` when given on the
      command line, used as given; otherwise the data's vocabulary rounded up to a multiple of
      :data:`PAD_MULTIPLE` (64, for fast matmuls: byte data 257 -> 320, GPT-2 50,257 -> 50,304,
      Llama 3 128,256 stays), and the preset's ``model.vocab_size`` only when the data's is unknown.
      A model vocabulary smaller than the data's is refused (:func:`check_vocab_fits`), whoever set it;
      the token ids are still checked against it: their recorded maxima when a run starts
      (:func:`recover.data.verify.check_data`), every one by ``recover prepare --verify``.

Everything here is torch-free and reads at most the first shard's header: ``recover launch`` runs it
before it starts any process.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recover.errors import ConfigError, DataError

if TYPE_CHECKING:
    from recover.config import Config, DataConfig
    from recover.data.shards import TokenDataset

PAD_MULTIPLE = 64
GPT2_VOCAB = 50257
LLAMA3_VOCAB = 128256
META_PKL = "meta.pkl"
BUILTIN_PREFIX = "builtin:"
SPLIT_OPTION = {"train": "--data.train_pattern", "val": "--data.val_pattern"}


@dataclass(frozen=True)
class Layout:
    """A naming convention for the two splits of a directory."""

    name: str
    """``recover``, ``nanogpt`` or ``llmc``."""
    train: str
    """Glob of the training shards."""
    val: str
    """Glob of the validation shards."""
    maker: str
    """Who writes it (for messages)."""

    def pattern(self, split: str) -> str:
        return self.train if split == "train" else self.val


LAYOUTS = (
    Layout("recover", "train_*.bin", "val_*.bin", "recover prepare"),
    Layout("nanogpt", "train.bin", "val.bin", "nanoGPT"),
    Layout("llmc", "*_train*.bin", "*_val*.bin", "llm.c"),
)


def _files(directory: Path, pattern: str) -> list[Path]:
    from recover.data.shards import list_files

    return list_files(directory, pattern)


def looked_for(split: str) -> str:
    """``train_*.bin (recover prepare), train.bin (nanoGPT) or *_train*.bin (llm.c)``."""
    names = [f"{lay.pattern(split)} ({lay.maker})" for lay in LAYOUTS]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def detect_split(directory: str | Path, split: str) -> Layout:
    """The layout whose ``split`` pattern matches files in ``directory``.

    Raises:
        DataError: no layout matches, or several do; the message lists what was looked for and names
            the ``--data.*_pattern`` option.
    """
    directory = Path(directory)
    from recover.data.shards import file_names

    found = [lay for lay in LAYOUTS if file_names(directory, lay.pattern(split))]
    kind = "training" if split == "train" else "validation"
    if len(found) == 1:
        return found[0]
    option = SPLIT_OPTION[split]
    if found:
        which = " and ".join(f"{lay.maker}'s {lay.pattern(split)}" for lay in found)
        raise DataError(f"{directory} holds {kind} shards of several layouts ({which}); choose with {option} GLOB")
    raise DataError(f"no {kind} shards in {directory}: looked for {looked_for(split)}; name yours with "
                    f"{option} GLOB (a glob inside data.path), or write shards with `recover prepare FILES --out DIR`")


def open_split(directory: str | Path, split: str, fmt: str = "auto") -> TokenDataset:
    """The ``train`` or ``val`` shards of a directory in any layout."""
    from recover.data.shards import TokenDataset

    return TokenDataset(Path(directory) / detect_split(directory, split).pattern(split), fmt)


def split_pattern(data: DataConfig, directory: str | Path, split: str) -> str:
    """The glob of ``split`` inside ``directory``: ``data.<split>_pattern`` when set, else detected."""
    given = data.train_pattern if split == "train" else data.val_pattern
    return given or detect_split(directory, split).pattern(split)


def split_format(data: DataConfig, directory: str | Path, split: str) -> str:
    """``data.format``, except that ``auto`` on nanoGPT's detected ``train.bin``/``val.bin`` is ``nanogpt``:
    raw tokens by definition, never taken for an llm.c header whatever their first bytes."""
    given = data.train_pattern if split == "train" else data.val_pattern
    if data.format != "auto" or given or detect_split(directory, split).name != "nanogpt":
        return data.format
    return "nanogpt"


def split_paths(data: DataConfig, directory: str | Path, split: str) -> list[Path]:
    """The files of ``split``, sorted.

    Raises:
        DataError: no file: a given pattern is named with its option, a detected one as in
            :func:`detect_split`.
    """
    directory = Path(directory)
    pattern = split_pattern(data, directory, split)
    paths = _files(directory, pattern)
    if not paths:
        option = SPLIT_OPTION[split]
        raise DataError(f"{option[2:]} = {pattern!r} matches no file in {directory}; fix {option}, or leave it "
                        f"unset to detect {looked_for(split)}")
    return paths


class _PlainUnpickler(pickle.Unpickler):
    """Loads plain containers, strings and numbers only: a ``meta.pkl`` can run no code."""

    def find_class(self, module: str, name: str) -> type:
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; only plain dicts, strings and numbers load")


def load_meta_pkl(directory: str | Path) -> dict | None:
    """nanoGPT's ``directory/meta.pkl`` (``vocab_size``; ``stoi``/``itos`` for char-level data), or None.

    Raises:
        DataError: the file exists but is not a plain dict with an integer ``vocab_size``.
    """
    path = Path(directory) / META_PKL
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(f).load()
    except Exception as exc:  # any unpickling problem is a bad file
        raise DataError(f"{path}: unreadable as nanoGPT's meta.pkl ({exc}); delete it or re-create it") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] < 1:
        raise DataError(f"{path}: expected a dict with a positive integer 'vocab_size' (nanoGPT's meta.pkl); "
                        "delete it or re-create it")
    return meta


def _header_vocab(directory: Path, data: DataConfig) -> tuple[int, str] | None:
    """The vocabulary an llm.c header's magic names (first training shard), or None."""
    from recover.data.shards import GPT2_MAGIC, LLAMA3_MAGIC

    first = split_paths(data, directory, "train")[0]
    with open(first, "rb") as f:
        head = f.read(4)
    magic = int(np.frombuffer(head, dtype="<i4")[0]) if len(head) == 4 else None
    names = {GPT2_MAGIC: (GPT2_VOCAB, "GPT-2"), LLAMA3_MAGIC: (LLAMA3_VOCAB, "Llama 3")}
    if magic not in names:
        return None
    vocab, name = names[magic]
    return vocab, f"the {name} tokenizer that llm.c's header magic {magic} names ({first.name})"


def data_vocab(data: DataConfig, directory: str | Path) -> tuple[int, str] | None:
    """``(vocabulary size, where it comes from)`` of the data, or None when nothing records it.

    Raises:
        DataError: an unreadable ``meta.json``/``meta.pkl``, or no shards (the layout is needed).
    """
    from recover.data.shards import load_meta
    from recover.data.tokenizer import ByteTokenizer

    if data.path.startswith(BUILTIN_PREFIX):
        return ByteTokenizer.vocab_size, f"the byte tokenizer of {data.path}"
    directory = Path(directory)
    meta = load_meta(directory)
    if meta is not None and isinstance(meta.get("vocab_size"), int):
        return meta["vocab_size"], str(directory / "meta.json")
    pkl = load_meta_pkl(directory)
    if pkl is not None:
        return pkl["vocab_size"], str(directory / META_PKL)
    if data.train_pattern:
        return _header_vocab(directory, data)
    layout = detect_split(directory, "train")
    if layout.name == "nanogpt":
        return GPT2_VOCAB, f"GPT-2's, which nanoGPT assumes for a directory without {META_PKL}"
    if layout.name == "llmc":
        return _header_vocab(directory, data)
    return None


def padded(vocab: int) -> int:
    """``vocab`` rounded up to a multiple of :data:`PAD_MULTIPLE`."""
    return -(-vocab // PAD_MULTIPLE) * PAD_MULTIPLE


def model_vocab(configured: int, explicit: bool, data: tuple[int, str] | None) -> int:
    """The model's vocabulary: ``configured`` when given explicitly or when the data's is unknown,
    else the data's rounded up to a multiple of 64 (see the module docstring)."""
    if explicit or data is None:
        return configured
    return padded(data[0])


def check_vocab_fits(model_vocab_size: int, data: tuple[int, str] | None) -> None:
    """Raises DataError when the model's vocabulary is smaller than the data's."""
    if data is None or model_vocab_size >= data[0]:
        return
    vocab, source = data
    raise DataError(f"model.vocab_size = {model_vocab_size} is smaller than the data's vocabulary of {vocab} "
                    f"({source}); set --model.vocab_size {vocab} or more, or leave it out (then it is "
                    f"{padded(vocab)}: the data's, rounded up to a multiple of {PAD_MULTIPLE})")


def resolve_vocab(cfg: Config, directory: str | Path, explicit: bool) -> Config:
    """``cfg`` with ``model.vocab_size`` from :func:`model_vocab`; refuses one smaller than the data's.

    Raises:
        DataError: see :func:`check_vocab_fits` and :func:`data_vocab`.
    """
    data = data_vocab(cfg.data, directory)
    vocab = model_vocab(cfg.model.vocab_size, explicit, data)
    check_vocab_fits(vocab, data)
    return cfg if vocab == cfg.model.vocab_size else cfg.replace({"model.vocab_size": vocab})


def given(overrides: list[str] | tuple[str, ...], key: str) -> bool:
    """Whether the command-line ``overrides`` set ``key`` (``--key VALUE`` or ``--key=VALUE``)."""
    return any(arg == f"--{key}" or arg.startswith(f"--{key}=") for arg in overrides)


def resolve_data_dir(cfg: DataConfig) -> Path:
    """The shard directory of ``cfg.path`` (of the first source of ``cfg.sources``): ``builtin:NAME`` lives
    under ``cfg.cache_dir`` (:func:`recover.data.prepare.prepared_data_dir` prepares it on first use).

    Raises:
        ConfigError: a ``data.path`` that is not a directory, named with the two ways to make one.
    """
    if cfg.sources:
        return resolve_data_dir(cfg.parts()[0][0])
    if cfg.path.startswith(BUILTIN_PREFIX):
        return Path(cfg.cache_dir) / cfg.path[len(BUILTIN_PREFIX):]
    path = Path(cfg.path)
    if not path.is_dir():
        raise ConfigError(f"data.path = {cfg.path!r} is not a directory; prepare one with "
                          "`recover prepare FILES --out DIR` or use 'builtin:stdlib'")
    return path
