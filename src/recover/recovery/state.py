"""A replica's full training state as a flat ``{name: tensor}`` dict, for grow-back.

Contract: :func:`flat_state` and :func:`load_flat_state` are inverse. The dict holds tensors only
(parameters, AdamW moments and step counts, and integer counters such as the committed step), so
it can be broadcast over a process group to a joiner with no pickling; names are stable across
processes built from the same config, and the order is deterministic.
"""

from __future__ import annotations

import torch
from torch import nn


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer, counters: dict[str, int]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = p.detach()
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            out[f"optim.{name}.{key}"] = value.detach() if torch.is_tensor(value) else torch.tensor(value)
    for key, value in sorted(counters.items()):
        out[f"counter.{key}"] = torch.tensor(int(value), dtype=torch.int64)
    return out


@torch.no_grad()
def load_flat_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Copies ``state`` into ``model`` and ``optimizer`` in place; returns the counters."""
    params = dict(model.named_parameters())
    missing = [n for n in params if f"model.{n}" not in state]
    if missing:
        raise ValueError(f"transferred state lacks parameters {missing[:3]}... ({len(missing)} missing)")
    for name, p in params.items():
        p.copy_(state[f"model.{name}"])
        moments = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.startswith(f"optim.{name}.")
                   and k.count(".") == name.count(".") + 2}
        if moments:
            optimizer.state[p] = {k: v.clone() for k, v in moments.items()}
    return {k[len("counter."):]: int(v) for k, v in state.items() if k.startswith("counter.")}
