"""Sealed store entries: what a generation's group writes on the coordinator's store, only its members can make.

Contract: the c10d ``TCPStore`` the coordinator hosts authenticates nobody, and anyone who reaches its
port can list, read, write and delete keys. So a generation's group never uses a key in the clear:
under its rendezvous prefix (``gen{g}``, ``gen{g}/lane{k}``) every key is stored under
:func:`sealed_key`, an HMAC of the key keyed by the generation's ``secret``
(:class:`~recover.coord.protocol.Membership`: random, chosen by the coordinator, sent only to the
generation's members over their authenticated connections), and every value as :func:`seal` makes it,
a tag (an HMAC of the stored name and the value) before the value. Without the secret nobody can
compute the name of a key the group reads (listing the store shows opaque names only), nor a value
it accepts: a value written or overwritten by anyone else fails :func:`unseal` (``SealBroken``), so
the reader's rendezvous fails and the members move on to the next generation (the job is slowed,
never misled: a stranger cannot redirect a member to an address of its own). Counters (``add``)
are stored under sealed names without a tag (c10d increments them in the store).

Pure (standard library only): the coordinator computes the names it looks up
(:mod:`recover.coord.admission`), a worker's store wraps its client with them
(:mod:`recover.comm.store`).
"""

from __future__ import annotations

import hashlib
import hmac

TAG_BYTES = 16


class SealBroken(ValueError):
    """A stored value was not written by a holder of the generation's secret."""


def sealed_key(secret: str, prefix: str, key: str) -> str:
    """The store name of ``key`` under ``prefix`` for the generation of ``secret``: ``prefix/`` and 32 hex
    digits (an HMAC-SHA256 of the key, cut to 128 bits)."""
    digest = hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{prefix}/{digest}"


def _tag(secret: str, name: str, value: bytes) -> bytes:
    return hmac.new(secret.encode(), name.encode() + b"\0" + value, hashlib.sha256).digest()[:TAG_BYTES]


def seal(secret: str, name: str, value: bytes) -> bytes:
    """``value`` as stored under ``name``: its tag, then the value."""
    return _tag(secret, name, value) + value


def unseal(secret: str, name: str, raw: bytes) -> bytes:
    """The value sealed under ``name``. Raises SealBroken unless the tag is the secret's."""
    tag, value = raw[:TAG_BYTES], raw[TAG_BYTES:]
    if len(tag) < TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, name, value)):
        raise SealBroken(f"the store entry {name} was not written by a member of its generation")
    return value
