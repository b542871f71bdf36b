"""Records on disk: checksummed frames, appended, read back exactly; a torn tail is dropped.

```
 frame   = b"GT" | u32 payload length | u32 crc32(payload) | payload
 payload = u32 header length | header (JSON) | new_ids int32[] | output_ids int32[] | logprobs float32[]
           | routes uint8/uint16[positions, layers, top-k]   (a MoE call; header "rt")
```

Inputs are stored as ``EncodedRecord`` (reference, shared length, new ids), so a run's file
grows with its unique tokens, not with the contexts it re-sent. The codec knows nothing
about trees: ``TrajectoryTree`` produces and consumes the encoded form.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre_hpc.trajectory.records import CallMeta, EncodedRecord

MAGIC = b"GT"
_FRAME = struct.Struct("<2sII")
_U32 = struct.Struct("<I")
_ROUTES = {1: "<u1", 2: "<u2"}


def encode_frame(enc: EncodedRecord) -> bytes:
    routes = b""
    extra = {}
    if enc.routes is not None:
        n, layers, k = enc.routes.shape
        extra["rt"] = [enc.routes_from, n, layers, k, enc.routes.dtype.itemsize]
        routes = np.ascontiguousarray(enc.routes, dtype=_ROUTES[enc.routes.dtype.itemsize]).tobytes()
    header = json.dumps(
        {
            "run": enc.run_id,
            "i": enc.index,
            "call": enc.call_id,
            "role": enc.role,
            "ref": enc.ref,
            "shared": enc.shared,
            "new": len(enc.new_ids),
            "out": len(enc.output_ids),
            "meta": enc.meta.stored(),
            **extra,
        },
        separators=(",", ":"),
    ).encode()
    payload = b"".join(
        [
            _U32.pack(len(header)),
            header,
            np.ascontiguousarray(enc.new_ids, dtype="<i4").tobytes(),
            np.ascontiguousarray(enc.output_ids, dtype="<i4").tobytes(),
            np.ascontiguousarray(enc.output_logprobs, dtype="<f4").tobytes(),
            routes,
        ]
    )
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_payload(payload: bytes) -> EncodedRecord:
    (hlen,) = _U32.unpack_from(payload)
    h = json.loads(payload[4 : 4 + hlen])
    at = 4 + hlen
    new = np.frombuffer(payload, dtype="<i4", count=h["new"], offset=at)
    at += 4 * h["new"]
    out = np.frombuffer(payload, dtype="<i4", count=h["out"], offset=at)
    lp = np.frombuffer(payload, dtype="<f4", count=h["out"], offset=at + 4 * h["out"])
    routes, start = None, 0
    if "rt" in h:
        start, n, layers, k, size = h["rt"]
        flat = np.frombuffer(payload, dtype=_ROUTES[size], count=n * layers * k, offset=at + 8 * h["out"])
        routes = flat.reshape(n, layers, k).astype(_ROUTES[size][1:])
    return EncodedRecord(
        h["run"],
        h["i"],
        h["call"],
        h["role"],
        h["ref"],
        h["shared"],
        new.astype(np.int32),
        out.astype(np.int32),
        lp.astype(np.float32),
        CallMeta(**h["meta"]),
        routes,
        start,
    )


@dataclass
class ReadResult:
    records: list[EncodedRecord]
    torn_bytes: int
    """Bytes at the end that did not form a complete, checksummed frame (dropped)."""


def read_frames(data: bytes) -> ReadResult:
    """Every complete frame from the start; the first one that is not (a short, empty, corrupt or
    undecodable frame, or garbage) ends the read and everything from it on counts as torn."""
    records, at = [], 0
    while at + _FRAME.size <= len(data):
        magic, size, crc = _FRAME.unpack_from(data, at)
        payload = data[at + _FRAME.size : at + _FRAME.size + size]
        if magic != MAGIC or size < _U32.size or len(payload) < size or zlib.crc32(payload) != crc:
            break
        try:
            records.append(decode_payload(payload))
        except (ValueError, KeyError, TypeError, struct.error):  # checksummed, yet not a record
            break
        at += _FRAME.size + size
    return ReadResult(records, len(data) - at)


def write_records(path: str | Path, records: Iterable[EncodedRecord]) -> int:
    """Append frames; returns the bytes written."""
    data = b"".join(encode_frame(r) for r in records)
    with open(path, "ab") as fh:
        fh.write(data)
    return len(data)


def read_records(path: str | Path) -> ReadResult:
    return read_frames(Path(path).read_bytes())


def by_run(records: Iterable[EncodedRecord]) -> Iterator[tuple[str, list[EncodedRecord]]]:
    """Group a log's records per run, keeping each run's order."""
    runs: dict[str, list[EncodedRecord]] = {}
    for r in records:
        runs.setdefault(r.run_id, []).append(r)
    yield from runs.items()
