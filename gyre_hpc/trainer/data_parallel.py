"""One data-parallel optimizer step over the transport: pull, train, sum, apply, publish.

```
 every training cell                               the core, once all cells reported
   pull snapshot v (satellites)                      for each other contributor c:
   claim micro-steps (step.claims.work_once)           pull_gradient(c) → g += g_c
   report claimed indices                            apply(R): g/R, clip, AdamW → v+1
                                                     publish(weights, v+1)
```

Gradients are pulled and summed by the core (no remote accumulate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gyre_hpc.trainer.base import ApplyStats, Trainer
from gyre_hpc.transport.base import Transport


def add_into(total: np.ndarray, part: np.ndarray) -> None:
    """``total += part`` in place on all of torch's threads (numpy's ``+=`` runs on one: at ~1 GB/s
    seven contributors' 8B gradients take a minute a step)."""
    torch.from_numpy(total).add_(torch.from_numpy(part))


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
        add_into(grad, scratch)
    stats = trainer.apply(num_runs)
    transport.publish(trainer.weights(), stats.version)
    return stats
