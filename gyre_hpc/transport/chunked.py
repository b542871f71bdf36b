"""Bulk MPI calls in parts MPI can count.

Open MPI 4.1 has no large-count calls: a count past 2^31 - 1 makes mpi4py's shim raise
``MPI_ERR_ARG``, and an 8B model's float32 snapshot is 8.19e9 elements. Every call that moves a
model-sized buffer (a one-sided read of the core's snapshot or of a contributor's gradient) goes
through here, in parts of at most ``transport.mpi_chunk_mb`` MiB.

It knows nothing of what the buffer holds; every rank of the call must pass the same size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

MAX_BYTES = 1 << 30
"""The largest part: a byte count MPI's 32-bit ints hold with room to spare."""


def spans(nbytes: int, part_bytes: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` byte offsets covering ``nbytes`` in parts of at most ``part_bytes``."""
    if not 0 < part_bytes <= MAX_BYTES:
        raise ValueError(f"a part of {part_bytes} bytes; valid: 1 … {MAX_BYTES}")
    for at in range(0, nbytes, part_bytes):
        yield at, min(at + part_bytes, nbytes)


def as_bytes(buf: np.ndarray) -> np.ndarray:
    """``buf``'s memory as one flat byte array (it must be contiguous: MPI reads it in place)."""
    if not buf.flags.c_contiguous:
        raise ValueError("a bulk MPI buffer must be contiguous")
    return buf.reshape(-1).view(np.uint8)
