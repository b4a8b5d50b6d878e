"""A user's extra state (``Job(extra=...)``: an EMA, an LR scheduler) as tensors and JSON, never pickle.

Contract:
- ``extra`` is one object with ``state_dict()`` and ``load_state_dict()`` or a dict name -> such objects;
  :func:`parts` names them, sorted by name (a single object is the part ``""``).
- :func:`encode` splits a state dict into a JSON skeleton and its tensors, in a deterministic order:
  numbers, strings, booleans and None stay in the skeleton as themselves, lists as lists; a tensor is
  ``{"tensor": i}``, a tuple ``{"tuple": [...]}``, a dict ``{"dict": [[key, value], ...]}`` (so integer keys
  stay integers, as an optimizer's state dict needs). :func:`decode` is its inverse; anything else (a
  function, a NumPy scalar) is refused with one line naming the part and where in its state dict it is.
- :func:`to_tensors` carries a tree as plain tensors for a state transfer (``PREFIX.json``: the skeleton
  as UTF-8 bytes in a uint8 tensor, ``PREFIX.I``: the tensors); :func:`from_tensors` reads it back. A
  checkpoint keeps the skeleton in ``meta.json`` and the tensors in its DCP files
  (:mod:`recover.train.checkpoints.own_checkpoint`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def parts(extra: Any) -> dict[str, Stateful]:
    """``extra`` as named parts (None: none).

    Raises:
        TypeError: a part without ``state_dict()``/``load_state_dict()`` (named).
    """
    if extra is None:
        return {}
    if isinstance(extra, Mapping) and not all(isinstance(name, str) for name in extra):
        raise TypeError(f"extra's names {list(extra)} must be strings")
    named = dict(sorted(extra.items())) if isinstance(extra, Mapping) else {"": extra}  # by name: one order
    for name, part in named.items():
        if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
            label = f"extra[{name!r}]" if name else "extra"
            raise TypeError(f"{label} is a {type(part).__name__}; give an object with state_dict() and "
                            "load_state_dict() (a module, an LR scheduler) or a dict of such objects")
    return named


def state_of(named: dict[str, Stateful]) -> dict[str, Any]:
    return {name: part.state_dict() for name, part in named.items()}


def load_into(named: dict[str, Stateful], tree: dict[str, Any], source: str) -> None:
    """Each part's state from ``tree`` (``source`` names where it came from in the error).

    Raises:
        ValueError: the parts of ``tree`` are not those of ``named``.
    """
    if set(tree) != set(named):
        raise ValueError(f"{source} holds extra state {sorted(tree)}, this Job has {sorted(named)}; "
                         "pass the same extra= as the job that wrote it")
    for name, part in named.items():
        part.load_state_dict(tree[name])


def encode(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """``tree``'s JSON skeleton and its tensors (see the module docstring)."""
    tensors: list[torch.Tensor] = []
    return _encode(tree, tensors, "extra"), tensors


def _encode(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    if torch.is_tensor(value):
        tensors.append(value.detach())
        return {"tensor": len(tensors) - 1}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        for k in value:
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"{where} has a key of type {type(k).__name__}; state dict keys must be "
                                "strings or numbers to travel")
        return {"dict": [[k, _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(f"{where} is a {type(value).__name__}; extra state travels as tensors, numbers, strings, "
                    "booleans, None, lists, tuples and dicts: make it one of those in state_dict()")


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "tensor" in skeleton:
        return tensors[int(skeleton["tensor"])]
    if "tuple" in skeleton:
        return tuple(decode(v, tensors) for v in skeleton["tuple"])
    return {k: decode(v, tensors) for k, v in skeleton["dict"]}


def to_tensors(prefix: str, tree: Any) -> dict[str, torch.Tensor]:
    """``tree`` as plain tensors: ``PREFIX.json`` (the skeleton, UTF-8 bytes) and ``PREFIX.0``, ``PREFIX.1``, ..."""
    skeleton, tensors = encode(tree)
    raw = bytearray(json.dumps(skeleton, separators=(",", ":")).encode())
    return {f"{prefix}.json": torch.frombuffer(raw, dtype=torch.uint8),
            **{f"{prefix}.{i}": t for i, t in enumerate(tensors)}}


def from_tensors(prefix: str, state: Mapping[str, torch.Tensor]) -> Any:
    """The tree :func:`to_tensors` carried under ``prefix``; None when ``state`` has none."""
    raw = state.get(f"{prefix}.json")
    if raw is None:
        return None
    tensors = []
    while f"{prefix}.{len(tensors)}" in state:
        tensors.append(state[f"{prefix}.{len(tensors)}"])
    return decode(json.loads(raw.cpu().numpy().tobytes().decode()), tensors)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings that can travel (``lr``, ``betas``, ...: what an LR scheduler changed)."""
    out = []
    for group in optimizer.param_groups:
        kept = {}
        for key, value in group.items():
            try:
                encode(value)
            except TypeError:  # an optimizer's own object: it is set up alike on every replica
                continue
            if key != "params":
                kept[key] = value
        out.append(kept)
    return out


@torch.no_grad()
def set_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Inverse of :func:`hyperparameters` (a tensor setting is copied into the optimizer's own tensor)."""
    for group, values in zip(optimizer.param_groups, groups, strict=True):
        for key, value in values.items():
            if torch.is_tensor(group.get(key)) and torch.is_tensor(value):
                group[key].copy_(value)
            else:
                group[key] = value
