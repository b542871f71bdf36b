"""A training replica spread over the ranks of one cell: the leader calls, every member mirrors.

```
 leader (cell rank 0)                                  member m (cell rank 1 … n-1)
   replica.micro_step(seqs) ──Mirror(micro_step, seqs)──▶ trainer.micro_step(seqs)
     trainer.micro_step(seqs) ◀═══ tensor-parallel collectives (torch.distributed) ═══▶
   replica.load_snapshot(flat, v) ──Mirror──▶ trainer.load_snapshot(·, v)  (its slice, from the leader)
   replica.apply(R) ──Mirror──▶ trainer.apply(R)  (its slice of the summed gradient; each steps its own)
   replica.optimizer_state() ──Mirror──▶ gather(each rank's state)
```

A megatron trainer's verbs are collective over its model-parallel group: every rank of the cell
enters each one, in the same order, with the same arguments. The leader alone talks to the
controller and the transport, so ``MirroredTrainer`` wraps the leader's trainer and announces
each verb to the members before running it. Small arguments (a micro-step's sequences) ride in
the message; bulk ones (a snapshot, the summed gradient) are the trainer's to move: the leader
holds them whole and hands each member its slice (``trainer.megatron_backend``), so no member
holds the whole model. The replica knows nothing about roles or the schedule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gyre_hpc.runtime.protocol import Channel, Mirror, ProtocolError
from gyre_hpc.step.claims import MicroStats
from gyre_hpc.trainer.base import ApplyStats, Trainer
from gyre_hpc.trajectory.sequences import TrainSequence

NOTHING = np.zeros(0, dtype=np.float32)
"""What a member passes for the whole buffers it does not hold."""


class MirroredTrainer:
    """The Trainer protocol on the leader of a cell whose members hold the rest of the replica."""

    def __init__(self, local: Trainer, comm: Any, channel: Channel) -> None:
        self.local, self.comm, self.channel = local, comm, channel
        self.numel = local.numel
        self.members = range(1, comm.Get_size())

    @property
    def version(self) -> int:
        return self.local.version

    def _announce(self, verb: str, *args: Any) -> None:
        for member in self.members:
            self.channel.send(Mirror(verb=verb, args=args), member)

    def weights(self) -> np.ndarray:
        self._announce("weights")  # shards are gathered collectively
        return self.local.weights()

    def gradient(self) -> np.ndarray:
        self._announce("gradient")  # the replica's ranks reduce what they accumulated together
        return self.local.gradient()  # then whole on the leader: the transport reads it here

    def load_snapshot(self, flat: np.ndarray, version: int) -> None:
        self._announce("load_snapshot", version)
        self.local.load_snapshot(flat, version)

    def zero_grad(self) -> None:
        self._announce("zero_grad")
        self.local.zero_grad()

    def release_memory(self) -> None:
        self.local.release_memory()  # members release on the role switch the leader forwards

    def resume_memory(self) -> None:
        self.local.resume_memory()

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        self._announce("micro_step", sequences)
        return self.local.micro_step(sequences)

    def apply(self, num_runs: int) -> ApplyStats:
        self._announce("apply", num_runs)  # the core's sum of every contributor, in its gradient
        return self.local.apply(num_runs)

    def optimizer_state(self) -> dict:
        self._announce("optimizer_state")
        return {"ranks": self.comm.gather(self.local.optimizer_state(), root=0)}

    def load_optimizer_state(self, state: dict) -> None:
        ranks = state.get("ranks") if isinstance(state, dict) else None
        size = self.comm.Get_size()
        if not isinstance(ranks, list) or len(ranks) != size:
            # Checked before any member is told, so a refusal leaves the cell in step.
            raise ValueError(f"not the optimizer state of a replica over {size} ranks")
        self._announce("load_optimizer_state")
        self.local.load_optimizer_state(self.comm.scatter(ranks, root=0))


def mirror(trainer: Trainer, msg: Mirror, comm: Any) -> None:
    """A member's half of ``msg``: the same verb on its part of the replica."""
    verb, args = msg.verb, msg.args
    if verb == "load_snapshot":
        trainer.load_snapshot(NOTHING, *args)  # its slice comes from the leader
    elif verb == "optimizer_state":
        comm.gather(trainer.optimizer_state(), root=0)
    elif verb == "load_optimizer_state":
        trainer.load_optimizer_state(comm.scatter(None, root=0))
    elif verb in ("weights", "zero_grad", "micro_step", "gradient", "apply"):
        getattr(trainer, verb)(*args)
    else:
        raise ProtocolError(f"cell member: no trainer verb {verb!r}")
