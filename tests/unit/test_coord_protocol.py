"""Wire protocol: framing, size limit, version, schema checks (pure, no sockets)."""

from __future__ import annotations

import json
import struct

import pytest

from recover.coord.protocol import (
    CLIENT_TYPES,
    MAGIC,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameDecoder,
    Membership,
    ProtocolError,
    encode,
)

V = PROTOCOL_VERSION


def frame(body: bytes) -> bytes:
    return MAGIC + struct.pack(">I", len(body)) + body


def test_roundtrip_in_pieces() -> None:
    msgs = [{"type": "vote", "id": 3, "generation": 2, "step": 7, "ids": [0, 1, 2]}, {"type": "hb"}]
    data = b"".join(encode(m) for m in msgs)
    dec = FrameDecoder(CLIENT_TYPES)
    got = []
    for i in range(len(data)):  # byte by byte: frames split anywhere still decode
        got += dec.feed(data[i:i + 1])
    assert [g["type"] for g in got] == ["vote", "hb"]
    assert got[0]["ids"] == [0, 1, 2] and got[0]["v"] == V


def test_garbage_and_oversized_are_fatal() -> None:
    with pytest.raises(ProtocolError) as e:
        FrameDecoder().feed(b"GET / HTTP/1.1\r\n\r\n")
    assert e.value.code == "bad_magic" and e.value.fatal
    with pytest.raises(ProtocolError) as e:
        FrameDecoder().feed(MAGIC + struct.pack(">I", MAX_FRAME_BYTES + 1))
    assert e.value.code == "oversized" and e.value.fatal
    with pytest.raises(ProtocolError):
        encode({"type": "vote", "id": 1, "generation": 1, "step": 1, "ids": list(range(300_000))})


@pytest.mark.parametrize("body,code", [
    (b"\xff\xfe not json", "malformed"),
    (b"[1, 2]", "malformed"),
    (json.dumps({"v": 99, "type": "hb"}).encode(), "bad_version"),
    (json.dumps({"v": 1, "type": "hb"}).encode(), "bad_version"),  # wire protocol 1: its hbs were lists only
    (json.dumps({"v": V, "type": "launch_missiles"}).encode(), "unknown_type"),
    (json.dumps({"v": V, "type": "ok", "re": 1}).encode(), "unknown_type"),  # server-only type
    (json.dumps({"v": V, "type": "vote", "id": 1, "generation": True, "step": 1, "ids": []}).encode(), "malformed"),
    (json.dumps({"v": V, "type": "vote", "id": 1, "generation": 1, "step": 1, "ids": ["x"]}).encode(), "malformed"),
    (json.dumps({"v": V, "type": "register", "id": 1, "replica": 0, "join": False}).encode(), "malformed"),
    (b'{"v": %d, "type": "ack", "generation": NaN}' % V, "malformed"),
])
def test_bad_bodies_are_refused_without_losing_sync(body: bytes, code: str) -> None:
    dec = FrameDecoder(CLIENT_TYPES)
    items = dec.feed(frame(body) + encode({"type": "hb"}))
    assert isinstance(items[0], ProtocolError) and items[0].code == code and not items[0].fatal
    assert items[1]["type"] == "hb"  # the stream is still in sync


def test_membership_wire_roundtrip() -> None:
    m = Membership(3, (0, 2, 5), "127.0.0.1", 1234, step=9, dead=(1,), joined=(5,), min_members=2,
                   reason="join")
    assert Membership.from_wire(json.loads(json.dumps(m.to_wire()))) == m
    assert m.rank_of(5) == 2 and m.size == 3
    with pytest.raises(ProtocolError):
        Membership.from_wire({**m.to_wire(), "members": "0,1"})


def test_a_membership_carries_its_secret_on_the_wire_but_never_into_its_repr() -> None:
    m = Membership(3, (0, 2), "127.0.0.1", 1234, step=9, secret="5eC7e7")
    back = Membership.from_wire(json.loads(json.dumps(m.to_wire())))
    assert back.secret == "5eC7e7" and back.prefix() == "gen3" and back.prefix(1, 2) == "gen3/lane1"
    assert "5eC7e7" not in repr(m) and "5eC7e7" not in str(m)
    with pytest.raises(ProtocolError, match="secret"):
        Membership.from_wire({**m.to_wire(), "secret": 7})
