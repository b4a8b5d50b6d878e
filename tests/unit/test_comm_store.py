"""Sealed store entries (recover.coord.sealing, recover.comm.store): a stranger on the store port can list,
write and overwrite keys, and none of it reaches a generation's group."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from recover.comm.backends import make_process_group
from recover.comm.store import SealedStore
from recover.coord.sealing import SealBroken, seal, sealed_key, unseal


def test_names_and_seals_depend_on_the_secret() -> None:
    name = sealed_key("s", "gen3", "0/1")
    assert name.startswith("gen3/") and "0/1" not in name and len(name) == len("gen3/") + 32
    assert len({name, sealed_key("t", "gen3", "0/1"), sealed_key("s", "gen3", "0/2")}) == 3
    assert unseal("s", name, seal("s", name, b"addr")) == b"addr"
    for forged in (seal("t", name, b"addr"), seal("s", "gen3/other", b"addr"), b"addr", b""):
        with pytest.raises(SealBroken):
            unseal("s", name, forged)


@pytest.fixture()
def master() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)


def client(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=5))


def test_a_stranger_sees_opaque_names_and_cannot_forge_or_alter_an_entry(master: dist.TCPStore) -> None:
    member = SealedStore(client(master), "gen1", "f00d" * 8)
    member.set("probe/0", "127.0.0.1:5")
    assert member.get("probe/0") == b"127.0.0.1:5" and member.check(["probe/0"])
    member.wait(["probe/0"], timedelta(seconds=1))
    assert member.add("count", 2) == 2 and member.add("count", 1) == 3
    stranger = client(master)
    listed = stranger.list_keys()
    assert not any("probe" in k or "count" in k or "f00d" in k for k in listed), listed
    stranger.set("gen1/probe/1", "6.6.6.6:1")  # the old names in the clear: never read
    assert not member.check(["probe/1"])
    stranger.set(member.name("probe/0"), b"6.6.6.6:1")  # overwriting a listed entry: detected, not believed
    with pytest.raises(RuntimeError, match="was not written by a member"):
        member.get("probe/0")
    assert member.delete_key("count") and member.num_keys() >= 1


def test_a_gloo_group_forms_and_reduces_on_sealed_stores(master: dist.TCPStore) -> None:
    sums: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        pg = make_process_group("gloo", SealedStore(client(master), "gen2/lane0", "5ec"), r, 2, 10.0,
                                torch.device("cpu"))
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        sums[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sums == {0: [3.0] * 3, 1: [3.0] * 3}
    assert all(k.startswith("gen2/lane0/") and len(k) == len("gen2/lane0/") + 32 for k in client(master).list_keys())
