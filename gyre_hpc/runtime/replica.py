"""A training replica spread over the ranks of one cell: the leader calls, every member mirrors.

```
 leader (cell rank 0)                                  member m (cell rank 1 … n-1)
   replica.micro_step(seqs) ──Mirror(micro_step, seqs)──▶ trainer.micro_step(seqs)
     trainer.micro_step(seqs) ◀═══ tensor-parallel collectives (torch.distributed) ═══▶
   replica.load_snapshot(flat, v) ──Mirror──▶ trainer.load_snapshot(·, v)  (its slice, from the leader)
   replica.pull_slices(core, v) ──Mirror──▶ each rank pulls its weight slice from the core's rank at its place
   replica.publish_slices() ──Mirror──▶ each of the core's ranks publishes its weight slice
   replica.add_gradients(leaders) ──Mirror──▶ each rank pulls its counterparts' slices and sums
   replica.apply(R) ──Mirror──▶ trainer.apply(R)  (each steps its own slice of the summed gradient)
   replica.save_weights(dir) / save_optimizer(dir) ──Mirror──▶ each rank writes its own file
                                                            ──gather──▶ names, digests
   replica.load_weights(dir, v) ──Mirror──▶ each rank reads its own slice (resharded if need be)
   replica.hf_tensors(hosts, v) ──Mirror──▶ trainer.hf_tensors(hosts), read to its end  (whole
                                      tensors, one at a time, on each host: what its engine loads)
```

A megatron trainer's verbs are collective over its model-parallel group: every rank of the cell
enters each one, in the same order, with the same arguments. The leader alone talks to the
controller and the transport, so ``MirroredTrainer`` wraps the leader's trainer and announces
each verb to the members before running it. Small arguments (a micro-step's sequences) ride in
the message; bulk ones are the trainer's or the transport's to move: the leader holds a
snapshot whole and hands each member its slice (``trainer.megatron_backend``), and each rank
pulls its own slice of the other cells' gradients (every cell has the same layout, so a rank's
counterpart is the rank of the same number in that cell), so no member holds the whole model.
The replica knows nothing about roles or the schedule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre_hpc.rundir import checkpoint_optimizer, checkpoint_optimizer_ranks
from gyre_hpc.runtime.protocol import Channel, Mirror, ProtocolError
from gyre_hpc.step.claims import MicroStats
from gyre_hpc.trainer import weight_shards
from gyre_hpc.trainer.base import ApplyStats, SlicedTrainer
from gyre_hpc.trainer.data_parallel import add_gradients, publish_slice, pull_slice
from gyre_hpc.trajectory.sequences import TrainSequence
from gyre_hpc.transport.base import Transport

NOTHING = np.zeros(0, dtype=np.float32)
"""What a member passes for the whole buffers it does not hold."""


class MirroredTrainer:
    """The Trainer protocol on the leader of a cell whose members hold the rest of the replica."""

    def __init__(self, local: SlicedTrainer, comm: Any, channel: Channel) -> None:
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

    def hf_tensors(self, hosts: Sequence[int] = (0,), version: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole tensors of the current weights, one at a time, here if the leader is one of
        ``hosts`` (the members gather and send them meanwhile; a hosting member loads its own
        stream into its engine as ``version``): read it to its end."""
        self._announce("hf_tensors", tuple(hosts), version)
        yield from self.local.hf_tensors(hosts)

    def gradient(self) -> np.ndarray:
        self._announce("gradient")  # the replica's ranks reduce what they accumulated together
        return self.local.gradient()  # each rank's slice, where the transport reads it

    def pull_slices(self, transport: Transport, core: int, version: int) -> None:
        """Every rank loads its weight slice of ``version`` from the core's rank at its place
        (``core``: the core's leader, the leader's own counterpart)."""
        self._announce("pull_slice", core, version)
        pull_slice(self.local, transport, core, version)

    def publish_slices(self, transport: Transport) -> None:
        """Every rank of the core publishes its weight slice of the current version; returns once
        all have (a satellite may pull any of them as soon as the step is reported applied)."""
        self._announce("publish_slice")
        publish_slice(self.local, transport)
        self.comm.gather(None, root=0)

    def add_gradients(self, transport: Transport, leaders: Sequence[int]) -> None:
        """Every rank adds its counterparts' slices of the other cells' gradients (``leaders``:
        theirs; the leader's own counterpart is the leader)."""
        self._announce("add_gradients", tuple(leaders))
        add_gradients(self.local, transport, leaders)

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

    def save_weights(self, directory: Path) -> dict[str, str]:
        """Each rank writes its shard and digests it, in parallel: names and digests come back."""
        self._announce("save_weights", directory)
        return self._gathered(self.local.save_weights(directory, 0))

    def load_weights(self, directory: Path, version: int) -> None:
        self._announce("load_weights", directory, version)
        self.local.load_weights(directory, version, 0)

    def _gathered(self, mine: dict[str, str]) -> dict[str, str]:
        return {name: digest for got in self.comm.gather(mine, root=0) for name, digest in got.items()}

    def save_optimizer(self, directory: Path) -> dict[str, str]:
        """Each rank writes its own state and digests it, in parallel; only names and digests
        come back here (nothing is pickled through MPI but them)."""
        self._announce("save_optimizer", directory)
        return self._gathered(self.local.save_optimizer(directory, 0))

    def load_optimizer(self, directory: Path) -> None:
        size, found = self.comm.Get_size(), checkpoint_optimizer_ranks(directory)
        # Checked before any member is told, so a refusal leaves the cell in step.
        if found != [checkpoint_optimizer(directory, r) for r in range(size)]:
            raise ValueError(f"{directory}: not the optimizer state of a replica over {size} ranks")
        if reason := weight_shards.other_layout(directory, self.local.layout):  # resharded weights
            raise ValueError(reason)
        self._announce("load_optimizer", directory)
        self.local.load_optimizer(directory, 0)


def mirror(trainer: SlicedTrainer, msg: Mirror, comm: Any, transport: Transport) -> None:
    """A member's half of ``msg``: the same verb on its part of the replica."""
    verb, args = msg.verb, msg.args
    if verb == "add_gradients":  # its counterpart in each contributor: the same cell rank
        (leaders,) = args
        add_gradients(trainer, transport, [leader + comm.Get_rank() for leader in leaders])
    elif verb == "pull_slice":
        core, version = args
        pull_slice(trainer, transport, core + comm.Get_rank(), version)
    elif verb == "publish_slice":
        publish_slice(trainer, transport)
        comm.gather(None, root=0)
    elif verb == "load_snapshot":
        trainer.load_snapshot(NOTHING, *args)  # its slice comes from the leader
    elif verb in ("save_weights", "save_optimizer"):
        comm.gather(getattr(trainer, verb)(*args, comm.Get_rank()), root=0)
    elif verb in ("load_weights", "load_optimizer"):
        getattr(trainer, verb)(*args, comm.Get_rank())
    elif verb == "hf_tensors":  # a rank among the hosts loads it (``cell_member``)
        hosts, _ = args
        for _ in trainer.hf_tensors(hosts):  # nothing arrives here: this rank gathers and sends
            pass
    elif verb in ("weights", "zero_grad", "micro_step", "gradient", "apply"):
        getattr(trainer, verb)(*args)
    else:
        raise ProtocolError(f"cell member: no trainer verb {verb!r}")
