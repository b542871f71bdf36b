"""The ``emulated`` trainer: the torch trainer's buffers, optimizer and checkpoints, with the
forward/backward of a micro-step replaced by a calibrated delay (seconds per token).

It pairs with the emulated engine to run many cells on few CPU cores: the claim loop, gradient
pulls, the optimizer step, snapshot publication and weight loading all run for real on the tiny
model's buffers, so the control plane is measured, not modelled. The gradient stays zero, so
the weights do not learn; the rewards of an emulated run say nothing about learning.
"""

from __future__ import annotations

import time

from gyre_hpc.step.claims import MicroStats, micro_stats
from gyre_hpc.trainer.base import ApplyStats
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.packing import forwarded_tokens
from gyre_hpc.trajectory.sequences import TrainSequence


class EmulatedTrainer(TorchTrainer):
    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        tokens = forwarded_tokens(sequences) if self.packing == "tree" else sum(len(s) for s in sequences)
        time.sleep(tokens * self.config.emulated_s_per_token)
        return micro_stats(sequences, 0.0, tokens=tokens)

    def apply(self, num_runs: int) -> ApplyStats:
        stats = super().apply(num_runs)
        time.sleep(self.config.emulated_apply_s)
        return stats
