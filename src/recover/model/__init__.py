"""Decoder-only transformers: the model registry (:mod:`recover.model.spec`), the built-in Llama
(:mod:`recover.model.llama`), building a model of any registered architecture and its size and cost.

Its names load on first use (PEP 562), so that importing it costs no torch: ``recover --help`` and the
launcher, which validate ``model.arch`` against the registry, start in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"Transformer": "recover.model.llama.model", "lm_loss": "recover.model.common",
          "build_model": "recover.model.build", "construct": "recover.model.build",
          "ModelStats": "recover.model.build", "model_stats": "recover.model.build",
          "ModelSpec": "recover.model.spec", "register": "recover.model.spec"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'recover.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
