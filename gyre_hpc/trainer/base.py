"""What every trainer backend does (``torch`` here, ``megatron`` on GPU clusters).

```
  load_snapshot(flat, v) ─▶ micro_step(seqs) … micro_step(seqs) ─▶ gradient in the exposed buffer
  core only:  apply(R) = grad/R → clip → optimizer → flat weights of v+1 ─▶ publish
```

A trainer knows nothing about MPI, cells or the schedule: it owns a model replica whose
parameters and gradients live in two flat float32 buffers laid out like
``engines.embedded.flat_parameters`` (unique parameters, in order), so snapshots and gradients
move as one contiguous block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gyre_hpc.trajectory.batch import TrainSequence


@dataclass(frozen=True)
class MicroStats:
    sequences: int
    tokens: int
    loss_tokens: int
    loss_sum: float
    """Σ weight·loss of the micro-step (divide by R for its share of the batch loss)."""
    clipped: int
    """Loss tokens whose importance ratio was clipped."""


@dataclass(frozen=True)
class ApplyStats:
    version: int
    grad_norm: float
    """Global gradient norm before clipping."""


class Trainer(Protocol):
    numel: int
    version: int

    def weights(self) -> np.ndarray:
        """The flat parameter buffer (a view, not a copy)."""

    def load_snapshot(self, flat: np.ndarray, version: int) -> None: ...

    def zero_grad(self) -> None: ...

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        """Forward/backward; gradients accumulate into the flat gradient buffer."""

    def gradient(self) -> np.ndarray:
        """The flat gradient buffer (a view)."""

    def apply(self, num_runs: int) -> ApplyStats:
        """Core only: the summed gradient is in ``gradient()``; one optimizer step."""
