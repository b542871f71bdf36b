"""A version's weights on their way into a server: named Hugging Face tensors that arrive one at a
time, cast to the served dtype into a staging buffer and handed on a bucket at a time.

```
 tensors ──▶ [ staging buffer of bucket_bytes ] ──▶ Staged(names, shapes, data, last)
 (views of a flat snapshot,    a tensor that does not fit sends the bucket so far first;
  or a megatron cell's slices  one larger than a bucket is staged alone
  gathered tensor by tensor)
```

At any moment this side holds one staging buffer (a bucket, or the one tensor larger than a
bucket) and the tensor that arrived last: a bucket plus the largest tensor, never the model.
Buckets are cut in arrival order by the same rule as ``engines.sglang.buckets``, so a stream in
the shared layout's order (``served_tensors``) cuts exactly those. This module does not know where
a bucket goes (a shared-memory file, a GPU, a broadcast): ``allocate`` says where buffers live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from gyre_hpc.models.flat import FlatLayout

Tensors = Iterable[tuple[str, torch.Tensor]]
"""Named Hugging Face tensors, each whole, each read once as it arrives."""


@dataclass(frozen=True)
class Staged:
    """One bucket, staged: ``data`` (1-D, the served dtype) holds its tensors back to back."""

    names: list[str]
    shapes: list[list[int]]
    data: torch.Tensor
    last: bool
    """No bucket follows (the one that may flush the server's cache)."""


def served_tensors(layout: FlatLayout, weights: np.ndarray | Tensors) -> Tensors:
    """A flat snapshot's tensors, or a stream of whole tensors under the layout's names, as a
    checkpoint names them (what a server loads), in order: views, fused experts an expert at a
    time (one copy of one expert held at a time, for transformers' conversion)."""
    if isinstance(weights, np.ndarray):
        weights = layout.pieces(torch.from_numpy(weights))
    return layout.as_checkpoint(weights)


@dataclass
class Stager:
    """Cuts ``Tensors`` into staged buckets; reports what it held at most."""

    dtype: torch.dtype
    bucket_bytes: int
    allocate: Callable[[int], torch.Tensor]
    """A 1-D buffer of that many elements of ``dtype`` where the server reads it."""
    peak_bytes: int = 0
    """The largest staging buffer held so far."""
    elements: int = 0
    """Elements staged by the last ``stage``."""
    largest: int = 0
    """Bytes of the largest tensor that arrived (in the served dtype)."""
    _buffer: torch.Tensor | None = field(default=None, repr=False)

    def stage(self, tensors: Tensors) -> Iterator[Staged]:
        """Each bucket, staged, as soon as the tensor after it arrives (or the stream ends). The
        buffer is reused: a bucket must be sent before the next is asked for."""
        itemsize = self.dtype.itemsize
        limit = max(self.bucket_bytes // itemsize, 1)
        names: list[str] = []
        shapes: list[list[int]] = []
        used = 0
        buffer: torch.Tensor | None = None
        self.elements = 0
        for name, t in tensors:
            n = t.numel()
            self.largest = max(self.largest, n * itemsize)
            if names and used + n > limit:
                yield Staged(names, shapes, buffer[:used], last=False)  # type: ignore[index]
                names, shapes, used = [], [], 0
            if not names:
                buffer = None  # the last bucket's, let go before another is made
                buffer = self._buffer_for(n, limit)
            buffer[used : used + n].copy_(t.reshape(-1))  # type: ignore[index]
            names.append(name)
            shapes.append(list(t.shape))
            used += n
            self.elements += n
        if names:
            yield Staged(names, shapes, buffer[:used], last=True)  # type: ignore[index]
        self._buffer = None  # nothing staged between pushes

    def _buffer_for(self, n: int, limit: int) -> torch.Tensor:
        """The reusable bucket, or (larger than a bucket) one of the tensor's own size in its place."""
        if n > limit:
            self._buffer = None  # dropped before the larger one is made
            buffer = self.allocate(n)
        else:
            if self._buffer is None or self._buffer.numel() < limit:
                self._buffer = None
                self._buffer = self.allocate(limit)
            buffer = self._buffer
        self.peak_bytes = max(self.peak_bytes, buffer.numel() * self.dtype.itemsize)
        return buffer
