"""Reusable flat buffers for the copies that fault-tolerant collectives reduce, lent until released.

Contract:
- ``take(numel, dtype, device)`` lends a 1-D buffer that nobody else holds: one its last borrower
  released, or a fresh one.
- ``release(results)``: the caller is done with ``results`` (tensors viewing buffers this pool lent: a
  collective's outputs) and with every view of them; their buffers may be lent again. Release once,
  after the last use: a second release of the same results, after their buffer was lent again, would
  lend it twice. Tensors that view no lent buffer are ignored.
- ``evict(bufs)``: never lend these again (a broken collective's parked work may still write into them).
- A buffer that is never released is never lent again: safety needs no release, only reuse does. The
  pool holds at most ``per_key`` buffers per key, lent or free; when all of a key's are lent and another
  is needed, it forgets its oldest loan (that buffer is then its borrower's alone, never lent again), so
  loans nobody releases age out instead of holding their slots for good.

Why reuse: a fresh 40 MB buffer is page-faulted in on first touch, which measured ~80 ms against ~9 ms
for copying into a warm one (2-core VM). CUDA tensors are not pooled (the caching allocator already
reuses memory, stream-safely), nor are empty ones.

Invariant: a buffer is lent again only after its borrower released it. Nothing inside torch decides
that: not ``torch._C._storage_Use_Count`` (it counts differently across versions: on 2.6 a buffer was
lent again while a view of it lived), nor weak references to tensors (on torch 2.9 a tensor reached
through one was freed under its Python object once its views died).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """At most ``per_key`` pooled buffers (lent or free) per (numel, dtype, device); shared along a chain
    of generations."""

    def __init__(self, per_key: int = 2) -> None:
        self.per_key = per_key
        self._free: dict[Key, list[Tensor]] = {}
        self._lent: dict[int, tuple[Key, Tensor]] = {}  # by the address of the buffer's memory, oldest first

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Lends a buffer of ``numel`` elements (see the module docstring)."""
        if device.type != "cpu" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype, device)
        free = self._free.get(key)
        if free:
            buf = free.pop()
        else:
            buf = torch.empty(numel, dtype=dtype, device=device)
            loans = [a for a, (k, _) in self._lent.items() if k == key]
            if loans and len(loans) >= self.per_key:
                del self._lent[loans[0]]  # the oldest loan ages out
        self._lent[buf.data_ptr()] = (key, buf)
        return buf

    def release(self, results: Iterable[Tensor]) -> None:
        """The caller is done with ``results`` and every view of them: their buffers may be lent again."""
        for t in results:
            loan = self._lent.pop(t.untyped_storage().data_ptr(), None) if t.device.type == "cpu" else None
            if loan is not None:
                self._free.setdefault(loan[0], []).append(loan[1])

    def evict(self, bufs: Iterable[Tensor]) -> None:
        """Never lend these again (a broken collective may still write into them)."""
        for b in bufs:
            loan = self._lent.get(b.data_ptr())
            if loan is not None and loan[1] is b:
                del self._lent[b.data_ptr()]
