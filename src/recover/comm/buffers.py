"""Reusable flat buffers for the copies that fault-tolerant collectives reduce.

Contract: ``take(numel, dtype, device)`` returns a 1-D buffer that nobody else uses: a pooled one
whose storage has no other user (no live view handed out by an earlier collective), or a fresh one.
Reusing warm buffers matters on CPU: a fresh 40 MB buffer is page-faulted in on first touch, which
measured ~80 ms against ~9 ms for copying into a warm one (2-core VM). ``evict`` drops buffers that
a broken collective may still write into (its parked work holds them): they are never handed out
again. CUDA tensors are not pooled (the caching allocator already reuses memory, stream-safely).

Invariant: a buffer is handed out at most once per collective and never while a view of it lives.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unused(buf: Tensor) -> bool:
    if _use_count is None:
        return False
    # references: ``buf`` itself and the temporary storage object made here
    return _use_count(buf.untyped_storage()._cdata) <= 2


class BufferPool:
    """At most ``per_key`` buffers per (numel, dtype, device); shared along a chain of generations."""

    def __init__(self, per_key: int = 2) -> None:
        self.per_key = per_key
        self._bufs: dict[tuple[int, torch.dtype, torch.device], list[Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, busy: Iterable[Tensor] = ()) -> Tensor:
        """A buffer of ``numel`` elements not in ``busy`` (those taken for the same collective)."""
        if device.type != "cpu" or _use_count is None:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype, device)
        taken = {id(b) for b in busy}
        pool = self._bufs.setdefault(key, [])
        for buf in pool:
            if id(buf) not in taken and _unused(buf):
                return buf
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(pool) < self.per_key:
            pool.append(buf)
        return buf

    def evict(self, bufs: Iterable[Tensor]) -> None:
        """Never hand these out again (a broken collective may still write into them)."""
        gone = {id(b) for b in bufs}
        for key, pool in self._bufs.items():
            self._bufs[key] = [b for b in pool if id(b) not in gone]
