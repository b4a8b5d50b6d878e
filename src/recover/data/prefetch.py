"""Read-ahead of microbatches, so a step does not wait on storage.

    reads = Prefetcher(sampler.microbatch, steps=2, device=device)
    reads.ahead(step, my_ids)            # a step's share is known: read it in the background
    reads.ahead(step + 1, expected_ids)  # and, speculatively, the coming steps' expected shares
    for mb in my_ids:
        inputs, targets = reads.get(step, mb)   # ready, or waited for, or read here (a miss)

Contract:
- ``read(step, id)`` is a pure function of ``(step, id)`` (:meth:`~recover.data.sampler.Sampler.microbatch`,
  a user's ``samples``). :meth:`Prefetcher.get` returns exactly what ``read(step, id)`` returns (the
  same values, bitwise), whoever read it; for a CUDA ``device`` its tensors (in tuples, lists and dicts
  too) are in pinned memory (``pin_memory()``), ready for an asynchronous copy to the GPU (the thread
  makes ``device`` its current device first, as DataLoader's pinning thread does: no CUDA context is
  created on another GPU).
- ONE background daemon thread reads what :meth:`Prefetcher.ahead` scheduled, the oldest step first
  (orphans of a failure, scheduled late, go before the speculative reads of the next step), and calls
  ``read`` one at a time: ``read`` need not be thread-safe, only never called concurrently with itself
  (a miss read on the caller's thread waits for the read in flight).
- :meth:`Prefetcher.get` takes the batch out: ready (a hit), in flight (waited for; a hit), or read on
  the caller's thread (a miss: never scheduled, e.g. orphans, or a plan that changed; or scheduled but
  not started yet). An exception raised by a background read is raised by ``get`` of that key, on the
  caller's thread, unchanged (the same object: a :class:`~recover.errors.DataError` reads exactly as
  when read synchronously); nothing fails earlier or elsewhere.
- Bounded memory: ``get(step, ...)`` makes ``step`` the current step; batches of other steps than the
  current one and the ``steps + 1`` after it are dropped (and not read, if not started), and ``ahead``
  for a step before the current one is ignored. A caller that, about to compute a step, reads it and the
  ``steps`` after it ahead (as a replica does) holds at most ``steps + 1`` steps of its share. An
  ``ahead`` further on than the window (a joiner or a resume jumps ahead) moves the window there.
  Before any ``get``, the first ``ahead`` sets it.
- ``steps = 0``: no thread; ``ahead`` does nothing and every ``get`` reads on the caller's thread
  (synchronous reads).
- :attr:`Prefetcher.stats` counts hits, misses and the seconds ``get`` waited (for a batch in flight, or
  reading a miss): the time the training thread waited for data. :meth:`Prefetcher.take` returns them
  and starts counting again (once per step).
- :meth:`Prefetcher.close` stops the thread (it waits for the read in flight, up to :data:`JOIN_S`; its
  result is dropped) and drops every batch. At interpreter exit and when the prefetcher is garbage
  collected the thread is told to stop, without waiting. The thread is a daemon and holds no reference
  to the prefetcher: it never blocks the interpreter's exit. A closed prefetcher still serves ``get``
  (synchronously).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

Read = Callable[[int, int], Any]
Key = tuple[int, int]  # (step, id)

JOIN_S = 5.0
"""How long :meth:`Prefetcher.close` waits for a read in flight (the thread is a daemon past that)."""


def pinned(batch: Any) -> Any:
    """``batch`` with its CPU tensors in pinned memory (tuples, lists and dicts walked)."""
    if torch.is_tensor(batch):
        return batch if batch.device.type != "cpu" or batch.is_pinned() else batch.pin_memory()
    if isinstance(batch, (tuple, list)):
        return type(batch)(pinned(b) for b in batch)
    if isinstance(batch, dict):
        return {k: pinned(v) for k, v in batch.items()}
    return batch


@dataclass
class ReadStats:
    """What :meth:`Prefetcher.get` did since the last :meth:`Prefetcher.take`."""

    hits: int = 0
    """Batches read in the background (ready, or waited for while in flight)."""
    misses: int = 0
    """Batches read on the caller's thread."""
    wait_s: float = 0.0
    """Seconds ``get`` spent before returning: waiting for batches in flight and reading misses."""


@dataclass
class _Failed:
    """A background read that raised: ``get`` raises ``exc``."""

    exc: BaseException


class _Reads:
    """The state the thread and the caller share (the thread holds this, never the :class:`Prefetcher`)."""

    def __init__(self, read: Read, steps: int, pin: bool) -> None:
        self.read, self.steps, self.pin = read, steps, pin
        self.cuda_index: int | None = None  # the thread's current CUDA device (pin), set when it starts
        self.cond = threading.Condition()
        self.reading = threading.Lock()  # one call of read at a time, whichever thread
        self.current: int | None = None  # the current step (None: no get or ahead yet)
        self.queue: list[tuple[int, int, int]] = []  # (step, order, id): the oldest step first
        self.scheduled: set[Key] = set()  # in the queue, not started (a dropped key stays in the heap)
        self.in_flight: Key | None = None
        self.ready: dict[Key, Any] = {}
        self.order = itertools.count()
        self.stopped = False
        self.thread: threading.Thread | None = None

    def load(self, key: Key) -> Any:
        """``read(step, id)``, pinned when asked (exceptions propagate)."""
        with self.reading:
            batch = self.read(*key)
        return pinned(batch) if self.pin else batch

    def kept(self, step: int) -> bool:
        return self.current is not None and self.current <= step <= self.current + self.steps + 1

    def move(self, step: int) -> None:
        """(under ``cond``) ``step`` becomes the current step; what falls out of the window is dropped."""
        self.current = step
        self.ready = {k: v for k, v in self.ready.items() if self.kept(k[0])}
        self.scheduled = {k for k in self.scheduled if self.kept(k[0])}

    def run(self) -> None:
        """The thread: reads scheduled keys, the oldest step first, until stopped."""
        if self.cuda_index is not None:
            torch.cuda.set_device(self.cuda_index)  # pinned memory belongs to the replica's GPU's context
        while True:
            with self.cond:
                while not self.stopped and not self.queue:
                    self.cond.wait()
                if self.stopped:
                    return
                step, _, mb = heapq.heappop(self.queue)
                if (step, mb) not in self.scheduled:  # dropped, or taken by a miss
                    continue
                self.scheduled.discard((step, mb))
                self.in_flight = (step, mb)
            try:
                value: Any = self.load((step, mb))
            except BaseException as exc:  # noqa: BLE001 - raised by get() of this key, on the caller's thread
                value = _Failed(exc)
            with self.cond:
                self.in_flight = None
                if not self.stopped and self.kept(step):
                    self.ready[(step, mb)] = value
                self.cond.notify_all()

    def stop(self, wait_s: float) -> None:
        """Stops the thread, waiting up to ``wait_s`` for it to end (the read in flight)."""
        with self.cond:
            self.stopped = True
            self.queue.clear()
            self.scheduled.clear()
            self.ready.clear()
            self.cond.notify_all()
            thread = self.thread
        if wait_s > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)


class Prefetcher:
    """Reads microbatches of ``read(step, id)`` ahead of their use in one background thread (see the module
    docstring).

    Args:
        read: a pure function of ``(step, id)``.
        steps: steps of look-ahead kept beyond the current one (0: synchronous reads, no thread).
        device: where the batches go; a CUDA device: their tensors are pinned (asynchronous copies).
        name: the thread's name.

    Raises:
        ValueError: ``steps`` is not an integer >= 0.
    """

    def __init__(self, read: Read, steps: int = 2, device: str | torch.device | None = None,
                 name: str = "recover-prefetch") -> None:
        if isinstance(steps, bool) or int(steps) != steps or steps < 0:
            raise ValueError(f"steps of look-ahead must be an integer >= 0, got {steps!r}")
        self.device = torch.device(device) if device is not None else None
        self.pin = self.device is not None and self.device.type == "cuda"
        self.steps, self.name = int(steps), name
        self.stats = ReadStats()
        self._reads = _Reads(read, self.steps, self.pin)
        # garbage collected, or interpreter exit: the read in flight ends before the interpreter tears down (a
        # daemon thread inside torch when it does aborts the process)
        self._closer = weakref.finalize(self, self._reads.stop, JOIN_S)

    def ahead(self, step: int, ids: Iterable[int]) -> None:
        """Schedules ``ids`` of ``step`` for reading in the background (those not held or scheduled yet)."""
        r = self._reads
        if self.steps == 0:
            return
        with r.cond:
            if r.stopped:
                return
            if r.current is None or step > r.current + self.steps + 1:  # the first, or a jump ahead
                r.move(step - 1)
            if not r.kept(step):
                return  # an old step
            fresh = [(step, int(mb)) for mb in ids]
            fresh = [k for k in dict.fromkeys(fresh) if k not in r.ready and k not in r.scheduled
                     and k != r.in_flight]
            for key in fresh:
                heapq.heappush(r.queue, (key[0], next(r.order), key[1]))
                r.scheduled.add(key)
            if fresh:
                self._start()
                r.cond.notify_all()

    def get(self, step: int, mb: int) -> Any:
        """Microbatch ``mb`` of ``step``: ``read(step, mb)``'s value (see the module docstring).

        Raises:
            whatever ``read(step, mb)`` raised, in the background or here.
        """
        r, key = self._reads, (step, int(mb))
        t0 = time.perf_counter()
        with r.cond:
            if r.current != step:
                r.move(step)
            while r.in_flight == key:
                r.cond.wait()
            found = key in r.ready
            value = r.ready.pop(key, None)
            r.scheduled.discard(key)  # not started yet: read here rather than wait for the queue
        try:
            if not found:
                value = r.load(key)
        finally:
            self.stats.wait_s += time.perf_counter() - t0
            self.stats.hits += found
            self.stats.misses += not found
        if isinstance(value, _Failed):
            raise value.exc
        return value

    def take(self) -> ReadStats:
        """The counts since the last call (the data wait of a step), and counting starts again."""
        stats, self.stats = self.stats, ReadStats()
        return stats

    @property
    def pending(self) -> int:
        """Reads scheduled or in flight."""
        r = self._reads
        with r.cond:
            return len(r.scheduled) + (r.in_flight is not None)

    @property
    def alive(self) -> bool:
        """Whether the background thread is running."""
        thread = self._reads.thread
        return thread is not None and thread.is_alive()

    def close(self) -> None:
        """Stops the thread (after the read in flight) and drops every batch; ``get`` then reads synchronously."""
        self._closer.detach()
        self._reads.stop(JOIN_S)

    def _start(self) -> None:
        """(under ``cond``) The thread, on the first read scheduled."""
        r = self._reads
        if r.thread is None:
            if self.pin:  # CUDA is in use on the caller's thread by now
                assert self.device is not None
                r.cuda_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            r.thread = threading.Thread(target=r.run, name=self.name, daemon=True)
            r.thread.start()
