"""A cell: a fixed group of ranks holding one model replica; its leader talks to the controller.

```
   IDLE ──SwitchRole──▶ SAMPLING ◀──SwitchRole──▶ TRAINING      (DRAINING between the two
     │                      │                         │           once engines and trainers
     └──────── Shutdown ────┴──────── Shutdown ───────┘           exist)
```

The leader forwards every command to the members over the cell's own communicator and
acknowledges to the controller once the whole cell has switched. Standalone rollout engines are
one-rank cells that are only ever told to sample. A cell knows nothing about the schedule.
"""

from __future__ import annotations

import logging
import os
import time

from gyre_hpc.recipe.schema import CellsConfig, EngineConfig
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    Channel,
    Heartbeat,
    Hello,
    ProtocolError,
    Role,
    RoleSwitched,
    Shutdown,
    SwitchRole,
    wait_barrier,
)
from gyre_hpc.runtime.world import CONTROLLER, World

log = logging.getLogger(__name__)


class Cell:
    def __init__(self, world: World, cells: CellsConfig, engine: EngineConfig) -> None:
        assert world.unit is not None
        self.world, self.cells, self.engine = world, cells, engine
        self.unit: int = world.unit
        self.role = Role.IDLE
        self.to_controller = Channel(world.comm)
        self.in_cell = Channel(world.cell_comm)

    @property
    def address(self) -> str:
        return f"http://{self.world.env.hostname}:{self.engine.base_port + self.unit}"

    def run(self) -> None:
        if self.world.is_leader:
            self.lead()
        else:
            self.follow()
        wait_barrier(self.world.comm, self.cells.heartbeat_timeout_s)

    def lead(self) -> None:
        layout = self.world.layout
        self.to_controller.send(
            Hello(
                self.unit,
                self.world.rank,
                self.world.env.node_name,
                os.getpid(),
                self.address,
                self.cells.capacity,
                layout.is_standalone(self.unit),
            ),
            CONTROLLER,
        )
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self.to_controller.send(Heartbeat(self.unit, self.role, time.time()), CONTROLLER)
                next_beat = now + self.cells.heartbeat_s
            got = self.to_controller.poll(CONTROLLER)
            if got is None:
                time.sleep(POLL_INTERVAL_S)
                continue
            msg = got[1]
            if isinstance(msg, Shutdown):
                self._forward(msg)
                log.info("cell %d: shutdown (%s)", self.unit, msg.reason)
                return
            if isinstance(msg, SwitchRole):
                started = time.monotonic()
                self._forward(msg)
                self.role = msg.role
                self._await_members(msg.seq)
                seconds = time.monotonic() - started
                self.to_controller.send(RoleSwitched(self.unit, msg.role, msg.seq, seconds), CONTROLLER)
                log.info("cell %d: role %s (%.3f s)", self.unit, msg.role, seconds)

    def follow(self) -> None:
        while True:
            # No timeout: a leader that dies takes the job down, one that hangs is caught by the
            # controller's heartbeat check.
            _, msg = self.in_cell.recv(timeout=None, source=0)
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, SwitchRole):
                self.role = msg.role
                self.in_cell.send(RoleSwitched(self.unit, msg.role, msg.seq, 0.0), 0)

    def _forward(self, msg: SwitchRole | Shutdown) -> None:
        for member in range(1, self.world.cell_comm.Get_size()):
            self.in_cell.send(msg, member)

    def _await_members(self, seq: int) -> None:
        for member in range(1, self.world.cell_comm.Get_size()):
            _, ack = self.in_cell.recv(
                self.cells.heartbeat_timeout_s, member, f"ack from cell member {member}"
            )
            if not (isinstance(ack, RoleSwitched) and ack.seq == seq):
                raise ProtocolError(f"cell {self.unit}: member {member} answered {ack!r}")
