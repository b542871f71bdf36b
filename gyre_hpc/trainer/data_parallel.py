"""One data-parallel optimizer step over the transport: claim, train, pull, sum, apply, publish.

```
 every training cell                               the core, once all cells reported
   pull snapshot v (satellites)                      for each other contributor c:
   work_once: i = claim()  (fetch-and-add)             pull_gradient(c) → g += g_c
         i < known length → micro_step(queue[i])     apply(R): g/R, clip, AdamW → v+1
         queue closed and i ≥ n → gradient() → done  publish(weights, v+1)
         else: wait for more micro-steps
   report claimed indices
```

Faster or earlier cells take more micro-steps; each index is trained exactly once because the
counter hands it out once. Gradients are pulled and summed by the core (no remote accumulate).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.trainer.base import ApplyStats, MicroStats, Trainer
from gyre_hpc.trajectory.sequences import TrainSequence
from gyre_hpc.transport.base import Transport


@dataclass
class Claims:
    """One cell's part of one step's queue: what it knows of the queue and what it claimed.

    The queue may still grow (elastic: micro-steps arrive as prompt groups complete) until it is
    closed with its final length.
    """

    queue: list[list[TrainSequence]]
    closed: bool
    total: int = -1
    pending: int | None = None
    """An index taken from the counter whose micro-step has not arrived yet."""
    claimed: list[int] = field(default_factory=list)
    stats: list[MicroStats] = field(default_factory=list)
    stopped: bool = False
    """The step ended before the queue was exhausted: claim nothing more."""
    computed: float = 0.0
    """Seconds its micro-steps took (the rest of the session it waited)."""

    @classmethod
    def of(cls, queue: Sequence[list[TrainSequence]], closed: bool = True) -> Claims:
        return cls(list(queue), closed, len(queue) if closed else -1)

    def close(self, total: int, stop: bool = False) -> None:
        self.closed, self.total, self.stopped = True, total, stop

    @property
    def loss_sum(self) -> float:
        return sum(s.loss_sum for s in self.stats)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stats)

    @property
    def token_stats(self) -> TokenStats:
        return sum((s.token_stats for s in self.stats), TokenStats())


def work_once(claims: Claims, trainer: Trainer, transport: Transport) -> str:
    """Claim an index and train its micro-step: ``trained``, ``waiting`` (its micro-step is not
    packed yet) or ``done`` (the queue is closed and exhausted, or the step was stopped: an
    index claimed and not trained is reported by nobody, so the controller carries it)."""
    if claims.stopped:
        trainer.gradient()  # what it trained counts: it lands where the core reads it
        return "done"
    if claims.pending is None:
        claims.pending = transport.claim()
    i = claims.pending
    if i < len(claims.queue):
        started = time.monotonic()
        claims.stats.append(trainer.micro_step(claims.queue[i]))
        claims.computed += time.monotonic() - started
        claims.claimed.append(i)
        claims.pending = None
        return "trained"
    if claims.closed and i >= claims.total:
        trainer.gradient()  # what the trainer accumulated on its device lands where the core reads it
        return "done"
    return "waiting"


def pull_snapshot(trainer: Trainer, transport: Transport, expected: int, scratch: np.ndarray) -> None:
    version = transport.pull_snapshot(scratch)
    if version != expected:
        raise RuntimeError(f"snapshot holds version {version}, expected {expected}")
    trainer.load_snapshot(scratch, version)


def apply_on_core(
    trainer: Trainer, transport: Transport, contributors: Sequence[int], num_runs: int, scratch: np.ndarray
) -> ApplyStats:
    """Sum the contributors' gradients into the core's, step, and publish the new version."""
    grad = trainer.gradient()
    for rank in contributors:
        transport.pull_gradient(rank, scratch)
        grad += scratch
    stats = trainer.apply(num_runs)
    transport.publish(trainer.weights(), stats.version)
    return stats
