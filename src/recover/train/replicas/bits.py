"""Tensors as bits: exact fingerprints computed where the tensors live, and host reads that cost one
synchronisation.

Contract:
- :func:`bit_sum` changes when any single bit of any of its tensors changes (see its docstring), and
  is computed on the tensors' device, so a fingerprint of a GPU model never copies it to the host.
- :func:`to_host` reads several small tensors with ONE device-to-host copy: on a GPU each ``.item()``
  or ``.cpu()`` drains the device's queue, so a step that reads k values one by one stalls k times.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

MASK = (1 << 64) - 1
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of ``t``'s bytes (same storage: writing it writes ``t``)."""
    return t.contiguous().view(-1).view(_INT_OF_SIZE[t.element_size()])


@torch.no_grad()
def flip_bit(t: torch.Tensor) -> None:
    """Flips one bit of the middle element of ``t`` in place, as silent data corruption would (fault
    injection: ``--corrupt``); :func:`bit_sum` changes, nothing else notices."""
    flat = bits(t.detach())
    flat[flat.numel() // 2] ^= 1 << 3


def bit_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The exact fingerprint of ``tensors`` on the device: the sum, modulo 2**64, of each tensor's bit
    patterns read as integers times an odd constant per tensor (int64 arithmetic wraps). Any single
    changed bit changes it (the change is +-2**k times an odd number: never 0 modulo 2**64), and so
    does moving values between tensors."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for k, t in enumerate(tensors):
        total += bits(t).sum(dtype=torch.int64) * (2 * k + 1)
    return total


_STRUCT = {torch.float64: "d", torch.float32: "f", torch.int64: "q", torch.int32: "i", torch.bool: "?"}


def to_host(*tensors: torch.Tensor) -> list[list[Any]]:
    """The values of several small tensors as Python lists, read with ONE device-to-host copy (one
    synchronisation, where a ``.item()`` or ``.cpu()`` per tensor would drain the device queue once
    each): their bytes travel in one buffer, each part padded to 8 bytes."""
    flat = [t.detach().reshape(-1).contiguous() for t in tensors]
    parts = []
    for t in flat:
        raw = t.view(torch.uint8)
        pad = -raw.numel() % 8
        parts.append(torch.cat([raw, raw.new_zeros(pad)]) if pad else raw)
    data = bytes(torch.cat(parts).tolist()) if parts else b""  # the one read
    out, offset = [], 0
    for t, part in zip(flat, parts, strict=True):
        out.append(list(struct.unpack_from(f"<{t.numel()}{_STRUCT[t.dtype]}", data, offset)))
        offset += part.numel()
    return out
