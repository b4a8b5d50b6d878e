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
  pool holds only weak references to what it lent: to count them against ``per_key`` and to find the
  buffer that released results view; they never make a buffer lendable. A lent buffer nobody releases is
  forgotten once it is garbage (a view keeps its buffer alive; under ``torch.inference_mode`` views do
  not, so a lease there may be forgotten before its release: that buffer is not reused, nothing worse).

Why reuse: a fresh 40 MB buffer is page-faulted in on first touch, which measured ~80 ms against ~9 ms
for copying into a warm one (2-core VM). CUDA tensors are not pooled (the caching allocator already
reuses memory, stream-safely), nor are empty ones.

Invariant: a buffer is lent again only after its borrower released it. No reference count inside torch
decides that (``torch._C._storage_Use_Count`` counts differently across torch versions: on 2.6 a buffer
was lent again while a view of it lived).
"""

from __future__ import annotations

import weakref
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
        self._lent: dict[int, tuple[Key, weakref.ref[Tensor]]] = {}  # by the address of the buffer's memory

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
            if self._pooled(key) >= self.per_key:
                return buf  # beyond the pool: not pooled, never lent again
        self._lent[buf.data_ptr()] = (key, weakref.ref(buf))
        return buf

    def release(self, results: Iterable[Tensor]) -> None:
        """The caller is done with ``results`` and every view of them: their buffers may be lent again."""
        for t in results:
            if t.device.type == "cpu":
                key, ref = self._lent.pop(t.untyped_storage().data_ptr(), (None, None))
                buf = ref() if ref is not None else None
                if key is not None and buf is not None:
                    self._free.setdefault(key, []).append(buf)

    def evict(self, bufs: Iterable[Tensor]) -> None:
        """Never lend these again (a broken collective may still write into them)."""
        for b in bufs:
            _, ref = self._lent.get(b.data_ptr(), (None, None))
            if ref is not None and ref() is b:
                del self._lent[b.data_ptr()]

    def _pooled(self, key: Key) -> int:
        """How many buffers of ``key`` the pool holds or has lent (dropping lent ones that are garbage)."""
        self._lent = {a: (k, ref) for a, (k, ref) in self._lent.items() if ref() is not None}
        return len(self._free.get(key, ())) + sum(k == key for k, _ in self._lent.values())
