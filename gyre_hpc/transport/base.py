"""The transport interface: one-sided snapshot pulls, gradient pulls and a shared claim counter.

```
  core (cell 0)                satellite / sampling cell            controller (rank 0)
  ┌───────────────────┐  pull  ┌──────────────────────┐  claim    ┌──────────────────┐
  │ snapshot  [v | w] │◀───────┤ pull_snapshot(v)     │──────────▶│ counter (int64)  │
  │ gradient  [g0]    │        │ gradient  [g_c]      │ fetch&add └──────────────────┘
  └─────────┬─────────┘        └──────────▲───────────┘
            └──────── pull_gradient(c) ───┘   (the core sums; no remote accumulate)
```

Every operation is one-sided: the rank that owns the memory takes no part, so a cell busy in
a forward pass still serves a pull. Memory is registered once, at start, collectively on every
rank of the world (ranks without a buffer register an empty one). Who may write when is the
runtime's protocol: the core publishes a version only while no pull of the previous one is in
flight, and a gradient is read only after its owner reported the step done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class TransportPlan:
    """Which rank holds what: the same on every rank."""

    params: int
    """Values in the flat weight buffer (float32)."""
    core: int
    """Rank of the core's leader: owns the snapshot."""
    counter: int
    """Rank that owns the micro-step counter (the controller)."""
    grad_ranks: tuple[int, ...]
    """Ranks exposing a gradient buffer (every cell leader)."""


class Transport(Protocol):
    name: str

    def publish(self, weights: np.ndarray, version: int) -> None:
        """Core only: make ``weights`` the snapshot of ``version`` (a local copy, under a lock)."""

    def pull_snapshot(self, into: np.ndarray) -> int:
        """Read the current snapshot into ``into``; returns its version."""

    def gradient_buffer(self) -> np.ndarray:
        """This rank's exposed gradient buffer (write the local gradient here)."""

    def pull_gradient(self, rank: int, into: np.ndarray) -> None:
        """Read rank's exposed gradient into ``into``."""

    def claim(self) -> int:
        """Atomically take the next micro-step index (0, 1, 2, …)."""

    def reset_counter(self) -> None:
        """Counter owner only: start a new queue at 0 (while nobody claims)."""

    def claimed(self) -> int:
        """Counter owner only: claims handed out so far (the counter's value)."""

    def close(self) -> None: ...
