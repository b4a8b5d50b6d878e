"""The hand-written TensorBoard encoder against bytes from the official encoders.

The expected bytes below were produced once by TensorBoard's own protobuf classes
(``tensorboard.compat.proto.event_pb2``: ``Event(...).SerializeToString()``) and its TFRecord CRC
(``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c``); the interop tier reads whole
files of a real run with TensorBoard's reader (tests/e2e/test_metrics_interop.py).
"""

from __future__ import annotations

import struct

from recover.observe.tensorboard import EventFileWriter, crc32c, event, masked_crc, record, scalar_value, text_value


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    assert crc32c(b"") == 0


def test_masked_crc_and_framing_match_tensorboard():
    assert masked_crc(b"abc") == 0x21F1576E
    assert record(b"abc").hex() == "0300000000000000b099490e6162636e57f121"


def test_events_match_protobuf_serialization():
    assert event(2.0, version="brain.Event:2").hex() == "0900000000000000401a0d627261696e2e4576656e743a32"
    assert event(1.5, 7, [scalar_value("a/b", 0.25)]).hex() == "09000000000000f83f10072a0c0a0a0a03612f62150000803e"
    assert event(2.0, 300, [text_value("faults", "r1: crash")]).hex() == (
        "09000000000000004010ac022a250a230a066661756c7473420f08071200420972313a2063726173684a080a060a0474657874")


def _records(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == masked_crc(data[i:i + 8])
        body = data[i + 12:i + 12 + n]
        assert struct.unpack_from("<I", data, i + 12 + n)[0] == masked_crc(body)
        out.append(body)
        i += 16 + n
    return out


def test_writer_appends_whole_records(tmp_path):
    w = EventFileWriter(tmp_path / "replica_0")
    w.scalars(3, {"train/loss": 2.5, "note": "not a number"}, wall_time=1.5)
    w.text(4, "faults", "r1: crash", wall_time=2.0)
    w.scalars(5, {"note": "nothing numeric"})  # no event at all
    data = w.path.read_bytes()  # flushed as written: a live job's file is complete so far
    w.close()
    w.scalars(6, {"train/loss": 1.0})  # after close: dropped, no error
    assert w.path.name.startswith("events.out.tfevents.")
    header, scalars, text = _records(data)
    assert header.endswith(b"\x1a\x0dbrain.Event:2")
    assert scalars == event(1.5, 3, [scalar_value("train/loss", 2.5)])
    assert text == event(2.0, 4, [text_value("faults", "r1: crash")])
    assert w.path.read_bytes() == data
