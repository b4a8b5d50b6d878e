"""TensorBoard event files, written without TensorFlow or tensorboard installed.

Contract: :class:`EventFileWriter` appends to ``DIR/events.out.tfevents.<time>.<host>.<pid>.0`` (a new
file per process: one writer per file, so processes on other machines can share ``DIR``'s parent on
shared storage) records that TensorBoard's reader loads: scalars (``Value.simple_value``) and text
(a string tensor under the ``text`` plugin). Each record is written whole in one unbuffered write, so a
live job is viewable and a killed writer loses at most the record it was writing. A write the disk
refuses costs one warning line on stderr and that record (these files are a view; ``metrics.jsonl`` is
the record of truth); the training never sees the error.

The format (TensorFlow's ``event.proto`` and ``summary.proto``, hand-encoded here):
  file   = record*, the first an Event holding only ``file_version = "brain.Event:2"``
  record = uint64le length, uint32le masked_crc32c(length), data, uint32le masked_crc32c(data)
  Event  = {1: wall_time double, 2: step int64, 3: file_version string, 5: summary Summary}
  Summary = {1: repeated Value}; Value = {1: tag, 2: simple_value float, 8: tensor, 9: metadata}
  text   = Value{tag, metadata {plugin_data {plugin_name "text"}}, tensor {dtype DT_STRING (7),
           tensor_shape {} (a scalar), string_val [utf-8 bytes]}}
``masked_crc32c(b) = ((c >> 15 | c << 17) + 0xA282EAD8) mod 2**32`` with ``c`` the CRC-32C (Castagnoli) of b.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # the reflected Castagnoli polynomial
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data`` (``crc32c(b"123456789") == 0xE3069283``)."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC of ``data``."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord framing ``data``."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, bytes or a message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_value(tag: str, value: float) -> bytes:
    """A ``Value`` message holding ``simple_value``."""
    return _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)


def text_value(tag: str, text: str) -> bytes:
    """A ``Value`` message holding a scalar string tensor for the text plugin."""
    metadata = _field(1, _field(1, b"text"))  # SummaryMetadata.plugin_data.plugin_name
    tensor = b"\x08\x07" + _field(2, b"") + _field(8, text.encode())  # dtype DT_STRING, shape [], string_val
    return _field(1, tag.encode()) + _field(8, tensor) + _field(9, metadata)


def event(wall_time: float, step: int | None = None, values: list[bytes] = (), version: str | None = None) -> bytes:
    """An ``Event`` message: a summary of ``values`` at ``step``, or the file's version header."""
    out = b"\x09" + struct.pack("<d", wall_time)
    if step is not None:
        out += b"\x10" + _varint(step)
    if version is not None:
        out += _field(3, version.encode())
    if values:
        out += _field(5, b"".join(_field(1, v) for v in values))
    return out


class EventFileWriter:
    """Appends TensorBoard records to a new event file under ``logdir`` (see the module docstring)."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.logdir / f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self._lock = threading.Lock()
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._warned = False
        self._write(event(now, version="brain.Event:2"))

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """One event at ``step`` holding a scalar per tag (non-numbers left out)."""
        parts = [scalar_value(tag, float(v)) for tag, v in values.items() if isinstance(v, (int, float))]
        if parts:
            self._write(event(wall_time or time.time(), step, parts))

    def text(self, step: int, tag: str, text: str, wall_time: float | None = None) -> None:
        """One text entry (markdown, as TensorBoard's Text tab renders it) at ``step``."""
        self._write(event(wall_time or time.time(), step, [text_value(tag, text)]))

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._file.closed:
                return
            try:
                self._file.write(record(data))
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    print(f"recover: TensorBoard file {self.path}: {exc}; its records are dropped while this lasts",
                          file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            self._file.close()
