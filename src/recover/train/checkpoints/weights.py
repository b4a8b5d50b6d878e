"""Model weights from a path, and ``--init-from``: pre-training that starts from them.

A path is one of (tried in this order):
- a ``recover export --format torch`` file ``model.pt`` (or a directory holding one);
- a Hugging Face directory (``config.json`` with a ``model_type`` a registered architecture maps,
  ``llama`` built in, and ``*.safetensors`` or ``pytorch_model*.bin``), converted by
  :mod:`recover.model.hf` (names and layouts: the architecture's :class:`~recover.model.spec.HFMapping`);
- a recover checkpoint directory, or a run directory (its newest intact checkpoint:
  :func:`recover.train.checkpoints.describe.resolve_checkpoint`).

Contract:
- :func:`open_weights` returns a :class:`Weights`: the source's model config, ``shapes()`` (read
  from metadata only: DCP ``.metadata``, safetensors headers) and ``state()`` (whole tensors, in
  recover's names and layouts, the output projection included when the source ties it: the spec's ``tied``).
- :func:`check_fits` compares a source with a model without reading tensors: every parameter of the
  model must be there with the same shape, nothing else may be, and the architecture and the head
  counts must agree (the same shapes with other heads would silently compute something else). Its errors are one
  line naming the tensor and both shapes. ``recover launch`` calls it (:func:`check_init_from`)
  before anything starts.
- :func:`load_initial_weights` is called by every rank of every replica on its WHOLE model right
  after :func:`~recover.model.build_model` and before the pipeline split, tensor parallelism and
  FSDP (:class:`~recover.train.replicas.replica.Replica`), so each rank shards the same full tensors and every
  replica starts from the same parameters. Step 0, a fresh optimizer: only the weights are taken.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recover.config import ModelConfig
from recover.errors import CheckpointError, ConfigError, RecoverError
from recover.model import hf
from recover.model.build import construct
from recover.model.spec import get as get_spec

TORCH_FILE = "model.pt"
Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Weights:
    """A model's weights somewhere on disk (see the module docstring)."""

    kind: str
    """``"checkpoint"``, ``"hf"`` or ``"torch"``."""
    path: Path
    """The checkpoint directory, HF directory or ``.pt`` file the weights are read from."""
    model: ModelConfig
    """The source's model shape."""
    shapes: Callable[[], Shapes]
    state: Callable[[], dict[str, torch.Tensor]]


def open_weights(path: str | Path) -> Weights:
    """The weights at ``path`` (nothing is read beyond configs and metadata yet).

    Raises:
        RecoverError: ``path`` is none of the kinds above, or is damaged.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a recover run or checkpoint directory, a Hugging Face "
                          "Llama directory or a model.pt from `recover export --format torch`")
    if path.is_file() or (path / TORCH_FILE).is_file():
        return _torch_file(path if path.is_file() else path / TORCH_FILE)
    if (path / "config.json").is_file() and _hf_files(path):
        return _hf_dir(path)
    from recover.train.checkpoints.describe import read_description, resolve_checkpoint

    ckpt = resolve_checkpoint(path)
    desc = read_description(ckpt)
    return Weights("checkpoint", ckpt, desc.model, lambda: _dcp_shapes(ckpt), lambda: read_checkpoint_state(ckpt))


# ---- recover checkpoints (DCP) ----------------------------------------------------------------------
def _dcp_shapes(ckpt: Path) -> Shapes:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    return {k.removeprefix("model."): tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def read_checkpoint_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's whole tensors from a complete, verified DCP checkpoint (any layout it was saved from)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    state = {k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    except Exception as exc:  # DCP raises a variety of errors on damaged files
        raise CheckpointError(f"checkpoint {ckpt} could not be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); it is damaged") from None
    return state


# ---- `recover export --format torch` -----------------------------------------------------------------
def _torch_file(path: Path) -> Weights:
    payload = _load_pt(path)
    try:
        model = ModelConfig(**payload["model_config"])
    except (KeyError, TypeError, ConfigError) as exc:
        raise ConfigError(f"{path}: not a `recover export --format torch` file (no usable model_config: {exc})") \
            from None
    state = payload["state_dict"]
    return Weights("torch", path, model, lambda: {k: tuple(v.shape) for k, v in state.items()}, lambda: dict(state))


def _load_pt(path: Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle and zip errors of every kind
        raise ConfigError(f"{path} is not a readable torch file ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("state_dict"), dict):
        raise ConfigError(f"{path}: not a `recover export --format torch` file (no state_dict)")
    return payload


# ---- Hugging Face directories ------------------------------------------------------------------
def _hf_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))


def _hf_dir(path: Path) -> Weights:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}/config.json is unreadable ({exc})") from None
    model = hf.model_config_from_hf(config, str(path))
    return Weights("hf", path, model, lambda: _hf_shapes(path, model),
                   lambda: hf.from_hf(_hf_state(path, model), model))


def require_safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("reading and writing safetensors needs the 'safetensors' package: "
                          "pip install 'recover-llm[export]'") from None
    return safetensors


def _hf_shapes(path: Path, model: ModelConfig) -> Shapes:
    files = _hf_files(path)
    if files[0].suffix != ".safetensors":
        return {k: tuple(v.shape) for k, v in hf.from_hf(_hf_state(path, model), model).items()}
    safetensors = require_safetensors()
    shapes: Shapes = {}
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = _recover_name(key, path, model)
                if name is not None:
                    shapes[name] = tuple(f.get_slice(key).get_shape())
    tied = get_spec(model.arch).tied
    if tied and tied[0] not in shapes and tied[1] in shapes:
        shapes[tied[0]] = shapes[tied[1]]  # tied: the embedding is the output projection
    return shapes


def _recover_name(key: str, path: Path, model: ModelConfig) -> str | None:
    try:
        return hf.recover_name(key, model)
    except KeyError as exc:
        raise ConfigError(f"{path}: {exc.args[0]}; recover's {model.arch} model has no place for it") from None


def _hf_state(path: Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in _hf_files(path):
        if file.suffix == ".safetensors":
            state.update(require_safetensors().torch.load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    for key in state:
        _recover_name(key, path, model)
    return state


# ---- --init-from -------------------------------------------------------------------------------------
def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def model_shapes(model_cfg: ModelConfig) -> Shapes:
    """Every tensor of a whole recover model of ``model_cfg`` (built on the meta device: no memory)."""
    return {k: tuple(v.shape) for k, v in construct(model_cfg, "meta").state_dict().items()}


def check_fits(src: Weights, model_cfg: ModelConfig, flag: str = "--init-from") -> None:
    """Raises ConfigError (one line, naming the tensor and both shapes) unless ``src`` fits ``model_cfg``."""
    where = f"{flag} {src.path}"
    if src.model.arch != model_cfg.arch:
        raise ConfigError(f"{where}: a model of architecture {src.model.arch!r} there and {model_cfg.arch!r} here: "
                          f"set --model.arch {src.model.arch}")
    have, want = src.shapes(), model_shapes(model_cfg)
    for name, shape in want.items():
        if name not in have:
            raise ConfigError(f"{where}: tensor {name} (shape {_fmt(shape)} in this model) is missing there; "
                              f"set the model config to the source's ({_describe(src.model)})")
        if have[name] != shape:
            raise ConfigError(f"{where}: tensor {name} has shape {_fmt(have[name])} there and {_fmt(shape)} in "
                              f"this model; set the model config to the source's ({_describe(src.model)})")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ConfigError(f"{where}: tensor {extra[0]} (shape {_fmt(have[extra[0]])}) has no place in this model; "
                          f"set the model config to the source's ({_describe(src.model)})")
    for field, name, what in (("n_heads", "n_heads", "query"), ("kv_heads", "n_kv_heads", "key/value")):
        theirs, ours = getattr(src.model, field), getattr(model_cfg, field)
        if theirs != ours:
            raise ConfigError(f"{where}: {theirs} {what} heads there and {ours} in this model (the same shapes, "
                              f"another attention): set --model.{name} {theirs}")


def _describe(m: ModelConfig) -> str:
    keys = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")
    values = asdict(m) | {"ffn_dim": m.hidden_dim, "n_kv_heads": m.kv_heads}
    return " ".join(f"--model.{k} {str(values[k]).lower() if isinstance(values[k], bool) else values[k]}"
                    for k in keys)


def _open_init(path: str | Path) -> Weights:
    try:
        return open_weights(path)
    except RecoverError as exc:
        raise type(exc)(f"--init-from: {exc}") from None


def check_init_from(path: str | Path, model_cfg: ModelConfig) -> None:
    """Everything about ``--init-from path`` that can be checked without reading the tensors; a rotary
    base or norm epsilon that differs from the source's (the weights still fit) is named on stderr."""
    src = _open_init(path)
    check_fits(src, model_cfg)
    for name in ("rope_theta", "norm_eps"):
        theirs, ours = getattr(src.model, name), getattr(model_cfg, name)
        if theirs != ours:
            print(f"recover: warning: --init-from {src.path}: model.{name} is {theirs} there and {ours} here; the "
                  f"weights are taken as they are (set --model.{name} {theirs} to compute as the source did)",
                  file=sys.stderr, flush=True)


@torch.no_grad()
def load_initial_weights(model: nn.Module, path: str | Path) -> None:
    """Overwrites every parameter of the whole ``model`` with the weights at ``path`` (see the contract).

    Raises:
        ConfigError: the weights do not fit the model (one line naming the tensor and both shapes).
    """
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    src = _open_init(path)
    check_fits(src, cfg)
    state = src.state()
    tied = get_spec(cfg.arch).tied
    if cfg.tie_embeddings and tied and not torch.equal(state[tied[0]], state[tied[1]]):
        raise ConfigError(f"--init-from {src.path}: its output projection is not its embedding (untied) and this "
                          "model ties them: set --model.tie_embeddings false")
    own = model.state_dict()
    model.load_state_dict({k: state[k].to(own[k].dtype) for k in own}, strict=True)
