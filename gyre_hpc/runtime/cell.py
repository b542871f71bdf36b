"""A cell: a fixed group of ranks holding one model replica; its leader talks to the controller.

```
   IDLE ──TakeRole──▶ SAMPLING ◀──TakeRole──▶ TRAINING
     │                 │ engine serves            │ engine paused; TrainStep → claim
     │                 │ LoadWeights → pull v     │ micro-steps; core: ApplyStep → v+1
     └──── Goodbye ────┴──────── Goodbye ─────────┘
```

The engine is one replica per tensor-parallel group of the cell's GPUs (``placement``),
each hosted by the rank at its first GPU: the leader hosts replica 0 (an HTTP server the proxy
calls) and the trainer; the members follow role switches and weight loads, each with the replica
it hosts. The torch backend computes on the leader; a megatron trainer spans every rank
of its cell (tensor-, pipeline- and data-parallel), and the members mirror each trainer verb
the leader calls (``runtime.replica``). Cell 0 — the core — owns the optimizer, publishes every
version through the transport and writes checkpoints. A cell knows nothing about the schedule.

Three modules, one concern each: ``cell_host`` (what every rank hosts: its engine part and its
trainer), ``cell_leader`` (rank 0: the controller's verbs) and ``cell_member`` (the rest: the
leader's verbs). This one starts the right one and ends it cleanly.
"""

from __future__ import annotations

from gyre_hpc.recipe.schema import CellsConfig, EngineConfig, TrainerConfig
from gyre_hpc.runtime.cell_host import CellSetup
from gyre_hpc.runtime.cell_leader import Leader
from gyre_hpc.runtime.cell_member import Member
from gyre_hpc.runtime.protocol import wait_barrier
from gyre_hpc.runtime.world import World


def run_cell(
    world: World, cells: CellsConfig, engine: EngineConfig, trainer: TrainerConfig, setup: CellSetup | None
) -> None:
    """This rank's part of its cell, until the controller's Goodbye: placed with the others
    (collective), then its loop; its engine stopped and its messages flushed however it ends."""
    rank = (Leader if world.is_leader else Member)(world, cells, engine, trainer, setup)
    rank.place()
    try:
        rank.serve()
    finally:
        if rank.engine is not None:
            rank.engine.stop()
    for channel in (rank.to_controller, rank.in_cell):
        channel.flush(cells.heartbeat_timeout_s)
    wait_barrier(world.comm, cells.heartbeat_timeout_s)
