"""One data-parallel optimizer step over the transport: pull, train, sum, apply, publish.

```
 every training cell                               the core, once all cells reported
   pull snapshot v (satellites)                      each rank, for each other contributor c:
     (megatron: each rank its slice, pull_slice)       pull_gradient(c's rank at its place) → g += g_c
   claim micro-steps (step.claims.work_once)         apply(R): g/R, clip, AdamW → v+1
   report claimed indices                            publish(weights, v+1); megatron: each rank
                                                       publish_slice(its weights, v+1)
```

Gradients are pulled and summed by the core (no remote accumulate). A replica spread over
several ranks sums slice by slice: each of the core's ranks pulls, from every contributor, the
rank at its own place in that replica (every cell has the same trainer layout), so no rank
moves or sums more than its slice. It knows nothing of which ranks those are (the runtime
says) or of what a slice holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from gyre_hpc.trainer.base import ApplyStats, SlicedTrainer, Trainer
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


def publish_slice(trainer: SlicedTrainer, transport: Transport) -> None:
    """This rank's weight slice of its trainer's version, for its counterparts to pull."""
    transport.publish_slice(trainer.weight_slice(), trainer.version)


def pull_slice(trainer: SlicedTrainer, transport: Transport, source: int, expected: int) -> None:
    """This rank's weights from ``source`` (the core's rank at its place), version ``expected``."""
    into = np.empty(transport.plan.slices[source], np.uint8)
    version, nbytes = transport.pull_slice(source, into)
    if version != expected:
        raise RuntimeError(f"rank {source}'s weight slice holds version {version}, expected {expected}")
    trainer.load_slice(into[:nbytes], version)


def add_gradients(trainer: Trainer, transport: Transport, sources: Sequence[int]) -> None:
    """The gradient each of ``sources`` exposes (this rank's slice of a contributor's replica)
    added into this rank's own: one slice-sized buffer, summed on all of torch's threads."""
    grad = trainer.gradient()
    part = np.empty_like(grad) if sources else grad
    for rank in sources:
        transport.pull_gradient(rank, part)
        add_into(grad, part)


def apply_on_core(
    trainer: Trainer,
    transport: Transport,
    sources: Sequence[int],
    num_runs: int,
    add: Callable[[Transport, Sequence[int]], None] | None = None,
) -> ApplyStats:
    """Sum the contributors' gradients into the core's, step, and publish the new version.
    ``add(transport, sources)`` sums them; by default this rank alone (``add_gradients``), a
    replica over several ranks passes one that has each rank pull its own slice."""
    if add is None:
        add_gradients(trainer, transport, sources)
    else:
        add(transport, sources)
    stats = trainer.apply(num_runs)
    if transport.plan.params:  # else no whole snapshot travels: the slices are published
        transport.publish(trainer.weights(), stats.version)
    return stats
