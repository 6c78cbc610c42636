"""TensorBoard event files without TensorBoard: scalars beside the metrics jsonl.

``torch.utils.tensorboard`` needs the ``tensorboard`` package (grpcio, protobuf, its data
server: tens of MB) only to write a format that is small: TFRecord framing (length, masked
CRC-32C of the length, payload, masked CRC-32C of the payload) around ``Event`` protocol buffers
whose ``summary`` holds ``(tag, simple_value)`` pairs. This module writes exactly that, with the
few protobuf fields hand-encoded, and reads it back (the test; ``onboard`` itself only writes).
``tensorboard --logdir <out>/train/tb`` shows the runs, one sub-folder per role.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf writes it (two's complement for negatives)
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None,
           scalars: dict[str, float] | None = None) -> bytes:
    """An ``Event``: wall_time (1, double), step (2, int64), file_version (3) or summary (5)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15"
                                       + struct.pack("<f", value))
                          for tag, value in scalars.items())  # Summary.value: tag, simple_value
        out += _field_bytes(5, values)
    return out


def _record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", _masked(head)) + data + struct.pack("<I", _masked(data))


class EventWriter:
    """Appends scalar events to one new ``events.out.tfevents.*`` file in ``logdir``."""

    def __init__(self, logdir: Path):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.logdir / (f"events.out.tfevents.{int(now)}.{socket.gethostname()}."
                                   f"{os.getpid()}.0")
        with self.path.open("ab") as f:
            f.write(_record(_event(now, 0, file_version="brain.Event:2")))

    def scalars(self, step: int, values: dict[str, float | int | None]) -> None:
        """One event holding every finite number of ``values`` (None and NaN are left out)."""
        vals = {k: float(v) for k, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if vals:
            with self.path.open("ab") as f:
                f.write(_record(_event(time.time(), step, scalars=vals)))


# ---- reading (tests, tools) ---------------------------------------------------------------------

def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _read_varint(buf, i)
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            val, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} not expected in a scalar event")
        yield num, wire, val


def records(path: Path) -> Iterator[bytes]:
    """The payloads of a TFRecord file, both CRCs checked."""
    data = Path(path).read_bytes()
    i = 0
    while i < len(data):
        head = data[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        (crc_head,) = struct.unpack("<I", data[i + 8:i + 12])
        payload = data[i + 12:i + 12 + n]
        (crc_data,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
        if crc_head != _masked(head) or crc_data != _masked(payload):
            raise ValueError(f"{path}: CRC mismatch in the record at byte {i}")
        yield payload
        i += 16 + n


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} over every event file of ``logdir`` (not recursive)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for rec in records(path):
            step = 0
            for num, _, val in _fields(rec):
                if num == 2:
                    step = int(val)
                elif num == 5:
                    for vnum, _, value in _fields(val):
                        if vnum != 1:
                            continue
                        tag, simple = None, None
                        for fnum, _, f in _fields(value):
                            if fnum == 1:
                                tag = f.decode()
                            elif fnum == 2:
                                (simple,) = struct.unpack("<f", f)
                        if tag is not None and simple is not None:
                            out.setdefault(tag, []).append((step, simple))
    return out
