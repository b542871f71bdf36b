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
import torch

from gyre_hpc.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from gyre_hpc.trajectory.batch import TrainSequence


def flat_slots(config: Qwen3Config) -> dict[str, tuple[int, torch.Size]]:
    """Hugging Face tensor name → (offset, shape) in a flat buffer: unique parameters, in order
    (a tied ``lm_head`` is the embedding's slot and is not listed)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    slots, at = {}, 0
    for name, p in model.named_parameters():
        slots[name] = (at, p.shape)
        at += p.numel()
    return slots


def flat_tensors(flat: np.ndarray, config: Qwen3Config) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of a flat buffer, as views."""
    t = torch.from_numpy(flat)
    return {name: t[at : at + shape.numel()].view(shape) for name, (at, shape) in flat_slots(config).items()}


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

    def optimizer_state(self) -> dict: ...

    def load_optimizer_state(self, state: dict) -> None: ...
