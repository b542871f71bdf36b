"""One data-parallel optimizer step over the transport: claim, train, pull, sum, apply, publish.

```
 every training cell                               the core, once all cells reported
   pull snapshot v (satellites)                      for each other contributor c:
   loop: i = claim()  (fetch-and-add)                  pull_gradient(c) → g += g_c
         i ≥ n → stop                                apply(R): g/R, clip, AdamW → v+1
         micro_step(queue[i])                        publish(weights, v+1)
   report claimed indices
```

Faster or earlier cells take more micro-steps; each index is trained exactly once because the
counter hands it out once. Gradients are pulled and summed by the core (no remote accumulate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gyre_hpc.trainer.base import ApplyStats, MicroStats, Trainer
from gyre_hpc.trajectory.batch import TrainSequence
from gyre_hpc.transport.base import Transport


@dataclass
class ClaimReport:
    claimed: list[int] = field(default_factory=list)
    stats: list[MicroStats] = field(default_factory=list)

    @property
    def loss_sum(self) -> float:
        return sum(s.loss_sum for s in self.stats)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stats)


def train_claimed(
    trainer: Trainer,
    transport: Transport,
    queue: Sequence[list[TrainSequence]],
    before_each: Callable[[int], None] = lambda i: None,
) -> ClaimReport:
    """Claim micro-steps until the queue is exhausted; gradients accumulate in the trainer."""
    report = ClaimReport()
    while (i := transport.claim()) < len(queue):
        before_each(i)
        report.stats.append(trainer.micro_step(queue[i]))
        report.claimed.append(i)
    return report


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
