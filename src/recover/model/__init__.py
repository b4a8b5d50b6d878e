"""Decoder-only transformer (Llama-style) and its size and cost figures.

Its names load on first use (PEP 562), so that ``recover.model.cli`` registers ``recover sample`` and
``recover export`` without importing torch: ``recover --help`` and the launcher start in a fraction of
a second.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"Transformer": "recover.model.llama", "lm_loss": "recover.model.llama", "build_model": "recover.model.build",
          "ModelStats": "recover.model.build", "model_stats": "recover.model.build"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'recover.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
