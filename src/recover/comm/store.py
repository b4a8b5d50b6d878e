"""A generation's view of the coordinator's store: every entry sealed with the generation's secret.

Contract: :class:`SealedStore` is a c10d ``Store`` (what ``ProcessGroupGloo``, NCCL's unique-id exchange
and the link probes are given) over a client of the coordinator's ``TCPStore``: key ``k`` of rank
``rank``'s lane in generation ``m`` is stored under
``sealed_key(m.secret, m.prefix(rank, ranks), k)`` and its value sealed (:mod:`recover.coord.sealing`).
It replaces c10d's ``PrefixStore`` for the generation: the same calls, with the names and values only
the generation's members can make. A value that fails its seal raises ``RuntimeError`` (c10d's own
store errors do too), so the rendezvous that read it fails like one a peer died in.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from recover.coord.sealing import SealBroken, seal, sealed_key, unseal


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # a list of ints from C++


class SealedStore(dist.Store):
    """``inner`` (a ``TCPStore`` client) seen through ``prefix`` and ``secret`` (see the module docstring)."""

    def __init__(self, inner: Any, prefix: str, secret: str) -> None:
        super().__init__()
        self.inner, self.prefix, self._secret = inner, prefix, secret

    def name(self, key: str) -> str:
        """Where ``key`` is stored."""
        return sealed_key(self._secret, self.prefix, key)

    def set(self, key: str, value: Any) -> None:
        name = self.name(key)
        self.inner.set(name, seal(self._secret, name, _bytes(value)))

    def get(self, key: str) -> bytes:
        name = self.name(key)
        try:
            return unseal(self._secret, name, self.inner.get(name))
        except SealBroken as exc:
            raise RuntimeError(f"store key {key!r} of {self.prefix}: {exc}") from None

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self.name(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self.name(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
