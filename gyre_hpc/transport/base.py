"""The transport interface: one-sided snapshot pulls, gradient pulls and a shared claim counter.

```
  core (cell 0)                satellite / sampling cell            controller (rank 0)
  ┌───────────────────┐  pull  ┌──────────────────────┐  claim    ┌──────────────────┐
  │ snapshot  [v | w] │◀───────┤ pull_snapshot(v)     │──────────▶│ counter (int64)  │
  │ slice   [v|n|w_i] │◀───────┤ pull_slice(i) rank i │ fetch&add └──────────────────┘
  │ gradient  [g0]    │        │ gradient  [g_c]      │
  └─────────┬─────────┘        └──────────▲───────────┘
            └──────── pull_gradient(c) ───┘   (the core sums; no remote accumulate)
```

The snapshot is the whole model in the shared flat layout (what engines load), on the core's
leader. A replica spread over ranks also moves as slices: each of the core's ranks exposes its
own slice of the weights, in the bytes its trainer keeps them (the training dtype), for the
rank at the same place in a satellite to pull.

Every operation is one-sided: the rank that owns the memory takes no part, so a cell busy in
a forward pass still serves a pull. Memory is registered once, at start, collectively on every
rank of the world (ranks without a buffer register an empty one). Who may write when is the
runtime's protocol: the core publishes a version only while no pull of the previous one is in
flight, and a gradient is read only after its owner reported the step done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class TransportPlan:
    """Which rank holds what: the same on every rank."""

    params: int
    """Values in the flat weight buffer (float32); 0 where no whole snapshot travels: megatron
    cells whose engines load from the cell's own slices (``runtime.main.transport_plan``)."""
    core: int
    """Rank of the core's leader: owns the snapshot."""
    counter: int
    """Rank that owns the micro-step counter (the controller)."""
    grads: Mapping[int, int]
    """Rank → float32 values of the gradient it exposes: every rank of a satellite cell that
    holds a slice of its replica (the whole model for a replica of one rank)."""
    slices: Mapping[int, int] = field(default_factory=dict)
    """Rank → bytes a core rank's weight slice may take (its values in float32: the training
    dtype takes at most that); empty where trainers move whole snapshots (torch)."""

    @property
    def grad_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.grads))


class Transport(Protocol):
    name: str
    plan: TransportPlan

    def publish(self, weights: np.ndarray, version: int) -> None:
        """Core only: make ``weights`` the snapshot of ``version`` (a local copy, under a lock)."""

    def pull_snapshot(self, into: np.ndarray) -> int:
        """Read the current snapshot into ``into``; returns its version."""

    def publish_slice(self, data: np.ndarray, version: int) -> None:
        """A core rank: ``data`` (bytes) becomes its weight slice of ``version``."""

    def pull_slice(self, rank: int, into: np.ndarray) -> tuple[int, int]:
        """Read core rank ``rank``'s weight slice into the front of ``into`` (bytes, at least the
        plan's size for that rank); returns its version and how many bytes it holds."""

    def gradient_buffer(self) -> np.ndarray:
        """This rank's exposed gradient buffer (write the local gradient here)."""

    def pull_gradient(self, rank: int, into: np.ndarray) -> None:
        """Read rank's exposed gradient into ``into`` (of the size the plan gives that rank)."""

    def claim(self) -> int:
        """Atomically take the next micro-step index (0, 1, 2, …)."""

    def reset_counter(self) -> None:
        """Counter owner only: start a new queue at 0 (while nobody claims)."""

    def claimed(self) -> int:
        """Counter owner only: claims handed out so far (the counter's value)."""

    def close(self) -> None: ...
