"""A bucketed all-reduce of a copy of a payload, its buckets launched as their tensors become final.

This is how the cross-replica reduction overlaps the backward of a replica's last microbatch, as DDP
overlaps its gradient buckets, while the gradients stay the replica's own (layer 2's invariant):

    r = group.reduction(payload, order)     # nothing is launched yet
    ... backward: r.final(i) as each gradient buffer i is complete (any order, from autograd hooks)
    reduced = r.result()                    # launches what is left, waits, returns the sums
    ... the optimizer step consumes reduced; then group.release(reduced)

Contract:
- Buckets are consecutive runs, in ``order`` (the order the caller expects the tensors to become
  final: reverse parameter order for a backward), of tensors with one (device, dtype), at most
  ``bucket_bytes`` each (the first at most ``first_bucket_bytes``, so communication starts early). The
  plan depends only on shapes, dtypes and ``order``: every member launches the same buckets in the
  same order, which collectives need.
- ``final(i)`` says tensor ``i`` will not change any more. A bucket is copied into a flat buffer and
  launched once all its tensors are final AND every bucket before it was launched. The caller's
  tensors are never written; a collective that fails half-way corrupts only the copies.
- ``final`` never raises: it runs inside autograd hooks. A failure while launching is kept, no further
  bucket is launched, and ``result()`` raises it (layer 1's ``PeerFailure``).
- ``result()`` marks every tensor final, launches the remaining buckets, waits and returns one tensor
  per payload tensor (views into the reduced copies). Called at most once. The copies are the group's
  (``_take``): the caller hands the results back to it once consumed (``group.release``).

Subclasses supply ``_take`` (a flat buffer), ``_start`` (launch one bucket's collective, returning its
work) and ``_finish`` (wait for all works); :class:`DeferredReduction` serves groups that have only a
blocking ``allreduce`` (nothing overlaps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

DEFAULT_BUCKET_BYTES = 16 << 20
FIRST_BUCKET_BYTES = 1 << 20


def plan_buckets(tensors: Sequence[Tensor], bucket_bytes: int, order: Sequence[int] | None = None,
                 first_bucket_bytes: int | None = None) -> list[list[int]]:
    """Buckets of indices into ``tensors``: consecutive runs along ``order`` (default: index order) with
    one (device, dtype), each at most ``bucket_bytes`` (the first at most ``first_bucket_bytes``; a larger
    tensor gets a bucket of its own). Pure; the same on every rank for the same shapes."""
    buckets: list[list[int]] = []
    key, size, cap = None, 0, first_bucket_bytes or bucket_bytes
    for i in order if order is not None else range(len(tensors)):
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        k = (t.device, t.dtype)
        if not buckets or k != key or size + nbytes > cap:
            if buckets:
                cap = bucket_bytes
            buckets.append([])
            key, size = k, 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def flatten_into(buf: Tensor, ts: list[Tensor]) -> Tensor:
    """``ts`` copied one after the other into the 1-D ``buf``."""
    if len(ts) == 1:
        return buf.copy_(ts[0].detach().reshape(-1))
    return torch.cat([t.detach().reshape(-1) for t in ts], out=buf)


def unflatten(like: Sequence[Tensor], buckets: list[list[int]], flats: list[Tensor]) -> list[Tensor]:
    """Views into ``flats`` shaped as ``like``, one per index of ``buckets``."""
    out: list[Tensor | None] = [None] * len(like)
    for idx, flat in zip(buckets, flats, strict=True):
        off = 0
        for i in idx:
            n = like[i].numel()
            out[i] = flat[off:off + n].view(like[i].shape)
            off += n
    return out  # type: ignore[return-value]


class Reduction:
    """The bucket bookkeeping of a streamed all-reduce (see the module docstring)."""

    def __init__(self, tensors: Sequence[Tensor], order: Sequence[int] | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, first_bucket_bytes: int | None = None) -> None:
        self.tensors = list(tensors)
        self.buckets = plan_buckets(self.tensors, bucket_bytes, order, first_bucket_bytes)
        self._bucket_of = {i: k for k, idx in enumerate(self.buckets) for i in idx}
        self._missing = [len(idx) for idx in self.buckets]
        self._final = [False] * len(self.tensors)
        self._launched = 0  # buckets launched so far, in plan order
        self.flats: list[Tensor] = []
        self.works: list[Any] = []
        self.error: BaseException | None = None

    @property
    def launched(self) -> int:
        """How many buckets have been launched (a measure of overlap)."""
        return self._launched

    def final(self, i: int) -> None:
        """Tensor ``i`` is complete; launches every bucket that is now ready, in plan order."""
        if self._final[i]:
            return
        self._final[i] = True
        self._missing[self._bucket_of[i]] -= 1
        while self.error is None and self._launched < len(self.buckets) and not self._missing[self._launched]:
            idx = self.buckets[self._launched]
            ts = [self.tensors[j] for j in idx]
            try:
                flat = flatten_into(self._take(sum(t.numel() for t in ts), ts[0].dtype, ts[0].device), ts)
                self.flats.append(flat)
                self.works.append(self._start(flat))
            except BaseException as exc:  # noqa: BLE001 - kept for result(): hooks must not raise
                self.error = exc
                return
            self._launched += 1

    def result(self) -> list[Tensor]:
        """Launches what is left, waits for every bucket and returns the sums (raises a kept failure)."""
        for i in range(len(self.tensors)):
            self.final(i)
        if self.error is not None:
            raise self.error
        self._finish(self.works, self.flats)
        return unflatten(self.tensors, self.buckets, self.flats)

    # ---- what a group supplies ---------------------------------------------------------------------
    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def _start(self, flat: Tensor) -> Any:
        raise NotImplementedError

    def _finish(self, works: list[Any], flats: list[Tensor]) -> None:
        raise NotImplementedError


class DeferredReduction:
    """A reduction for a group with only a blocking ``allreduce``: everything happens in ``result()``."""

    def __init__(self, allreduce: Callable[[Sequence[Tensor]], list[Tensor]], tensors: Sequence[Tensor]) -> None:
        self._allreduce, self.tensors = allreduce, list(tensors)

    def final(self, i: int) -> None:
        return None

    def result(self) -> list[Tensor]:
        return self._allreduce(self.tensors)
