"""The controller (rank 0): brings the cells up and drives their roles.

```
  start ─▶ Hello from every cell leader and rollout engine   (events: world_up, hello)
        ─▶ initial roles from the scheduler policy            (switch_role ▶ … ◀ role_switched)
        ─▶ ┌─ step k = 1 … run.steps ───────────────────────┐
           │  one heartbeat round from every cell            │ (events: step)
           └─────────────────────────────────────────────────┘
        ─▶ Shutdown to all ─▶ barrier                         (events: shutdown)
```

Until the RL loop lands, a step is one heartbeat round: the world stays up, cells report their
role, and a silent cell stops the run. The controller talks to cells only through ``Channel``
and records what happens only through the event log.
"""

from __future__ import annotations

import logging
import time

from gyre_hpc.observability.events import EventLog
from gyre_hpc.recipe.schema import CellsConfig, RunConfig, SchedulerConfig
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    Channel,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Role,
    RoleSwitched,
    Shutdown,
    SwitchRole,
    wait_barrier,
)
from gyre_hpc.runtime.world import World
from gyre_hpc.scheduler.policy import initial_roles

log = logging.getLogger(__name__)


class CellLost(RuntimeError):
    """A cell stopped reporting."""


class Controller:
    def __init__(
        self, world: World, run: RunConfig, cells: CellsConfig, scheduler: SchedulerConfig, events: EventLog
    ) -> None:
        self.world, self.run_cfg, self.cells, self.scheduler = world, run, cells, scheduler
        self.events = events
        self.channel = Channel(world.comm)
        self.hellos: dict[int, Hello] = {}
        self.roles: dict[int, Role] = {}
        self.last_seen: dict[int, float] = {}
        self._seq = 0

    def run(self) -> None:
        layout = self.world.layout
        self.events.emit(
            "world_up",
            size=layout.world_size,
            layout=layout.describe(),
            launcher=self.world.env.launcher,
            job_id=self.world.env.job_id,
        )
        self.gather_hellos()
        roles = initial_roles(self.scheduler.mode, layout.cells, self.scheduler.async_train_cells)
        roles += [Role.SAMPLING] * layout.pool  # standalone engines only ever sample
        self.switch(dict(enumerate(roles)))
        for step in range(1, self.run_cfg.steps + 1):
            started = time.monotonic()
            self.heartbeat_round()
            self.events.emit(
                "step",
                step=step,
                seconds=round(time.monotonic() - started, 4),
                roles={c: str(r) for c, r in self.roles.items()},
            )
        self.shutdown("completed")

    def gather_hellos(self) -> None:
        deadline = time.monotonic() + self.cells.hello_timeout_s
        while len(self.hellos) < self.world.layout.units:
            missing = sorted(set(range(self.world.layout.units)) - set(self.hellos))
            _, msg = self._receive(deadline, f"Hello from cells {missing}")
            if isinstance(msg, Hello):
                self.hellos[msg.cell] = msg
                self.roles[msg.cell] = Role.IDLE
                self.last_seen[msg.cell] = time.monotonic()
                self.events.emit(
                    "hello",
                    cell=msg.cell,
                    rank=msg.rank,
                    host=msg.host,
                    pid=msg.pid,
                    address=msg.address,
                    capacity=msg.capacity,
                    standalone=msg.standalone,
                )

    def switch(self, roles: dict[int, Role]) -> None:
        """Send every SwitchRole, then wait for all acknowledgements."""
        pending: dict[int, int] = {}
        for cell, role in roles.items():
            self._seq += 1
            pending[cell] = self._seq
            self.channel.send(SwitchRole(cell, role, self._seq), self.world.layout.leader(cell))
            self.events.emit("switch_role", cell=cell, role=str(role), seq=self._seq)
        deadline = time.monotonic() + self.cells.heartbeat_timeout_s
        while pending:
            _, msg = self._receive(deadline, f"RoleSwitched from cells {sorted(pending)}")
            if isinstance(msg, RoleSwitched) and pending.get(msg.cell) == msg.seq:
                del pending[msg.cell]
                self.roles[msg.cell] = msg.role
                self.events.emit(
                    "role_switched",
                    cell=msg.cell,
                    role=str(msg.role),
                    seq=msg.seq,
                    seconds=round(msg.seconds, 6),
                )

    def heartbeat_round(self) -> None:
        """Wait until every cell has reported once since now."""
        since = time.monotonic()
        deadline = since + self.cells.heartbeat_timeout_s
        while min(self.last_seen.values()) < since:
            self._receive(deadline, "heartbeats")

    def shutdown(self, reason: str) -> None:
        for unit in range(self.world.layout.units):
            self.channel.send(Shutdown(reason), self.world.layout.leader(unit))
        self.events.emit("shutdown", reason=reason)
        wait_barrier(self.world.comm, self.cells.heartbeat_timeout_s)

    def _receive(self, deadline: float, what: str) -> tuple[int, Message]:
        """The next message; heartbeats are booked here, and a silent cell raises CellLost."""
        while True:
            now = time.monotonic()
            self._check_alive(now)
            got = self.channel.poll()
            if got is not None:
                if isinstance(got[1], Heartbeat):
                    self.last_seen[got[1].cell] = now
                return got
            if now > deadline:
                raise ProtocolError(f"controller: no {what} in time")
            time.sleep(POLL_INTERVAL_S)

    def _check_alive(self, now: float) -> None:
        for cell, seen in self.last_seen.items():
            if now - seen > self.cells.heartbeat_timeout_s:
                hello = self.hellos[cell]
                raise CellLost(
                    f"cell {cell} (rank {hello.rank} on {hello.host}) silent for {now - seen:.0f} s"
                )
