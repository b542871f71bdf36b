"""The MPI fleet: everything the controller does *to cells*, behind ``scheduler.fleet.Fleet``.

```
 step kinds (scheduler.steps) ──▶ Fleet ┬─ MpiFleet: control messages to cell leaders (runtime.protocol)
 controller (start, shutdown)           └─ tests: an in-process fake on a scripted clock
   start()            every cell's Hello (address, capacity)
   switch(roles)      TakeRole → every RoleTaken           (several cells switch in parallel)
   load_weights(v)    LoadWeights → every Loaded         (engines pull snapshot v)
   train / extend / close_queue                                 (a step's micro-step queue)
   receive()          the one wait: books heartbeats, checks liveness, returns the next TrainDone
   apply(step, …)     ApplyStep to the core → StepApplied        (version v+1)
   shutdown(reason)
```

A fleet knows the cells' roles and the version the core has published; it knows nothing about
the schedule (which cell switches when: ``scheduler.policy``), executions or micro-step contents.
Messages that arrive while the fleet waits for something else are kept for ``receive``, never
dropped.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CellHours
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.recipe.schema import CellsConfig, EngineConfig
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    ApplyStep,
    Channel,
    CloseQueue,
    Goodbye,
    Heartbeat,
    Hello,
    Loaded,
    LoadWeights,
    Message,
    MicroSteps,
    ProtocolError,
    RoleTaken,
    StepApplied,
    TakeRole,
    TrainDone,
    TrainStep,
    wait_barrier,
)
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.trajectory.sequences import StepQueue
from gyre_hpc.transport.base import Transport


class CellLost(RuntimeError):
    """A cell stopped reporting."""


@dataclass(frozen=True)
class Waits:
    """How long the controller waits for a cell's word, beyond which the run fails naming it."""

    hello_s: float
    """For every Hello: a leader says it once its engine is up."""
    reply_s: float
    """For the answer to a switch or a load: a cell whose SGLang server died defers both until
    the server is back, heartbeating meanwhile (one that falls silent is lost after
    ``heartbeat_timeout_s`` all the same)."""

    @classmethod
    def of(cls, cells: CellsConfig, engine: EngineConfig) -> Waits:
        restart = engine.start_timeout_s if engine.backend == "sglang" else 0.0
        return cls(cells.hello_timeout_s + engine.start_timeout_s, cells.heartbeat_timeout_s + restart)


@dataclass
class Loads:
    """Weight loads into engines so far: bytes sent and seconds (the slowest engine of each)."""

    bytes: int = 0
    seconds: float = 0.0


class MpiFleet:
    """The fleet over MPI: rank 0 talks to each unit's leader with ``runtime.protocol`` messages."""

    def __init__(
        self,
        comm: object,
        layout: RankLayout,
        cells: CellsConfig,
        transport: Transport,
        events: ev.EventLog,
        waits: Waits,
        version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        hours: CellHours | None = None,
    ) -> None:
        self.comm, self.layout, self.config, self.waits = comm, layout, cells, waits
        self.transport, self.events, self.version, self.clock = transport, events, version, clock
        self.hours = hours or CellHours(clock())
        """Each cell's time by state, marked here as cells switch, load and train."""
        self.loads = Loads()
        self.channel = Channel(comm)
        self.cells = layout.cells
        self.units: dict[int, Hello] = {}
        self.roles: dict[int, Role] = {}
        self.last_seen: dict[int, float] = {}
        self.inbox: deque[Message] = deque()
        self._seq = 0
        self.liveness: list[Callable[[], None]] = []
        """Checks of the controller's own parts (its proxy workers), each raising if one died."""

    # ---- the one wait ---------------------------------------------------------------------------

    def _next(self) -> Message | None:
        """One poll: a kept message first, else the channel; heartbeats are booked, never returned."""
        if self.inbox:
            return self.inbox.popleft()
        for check in self.liveness:
            check()
        now = self.clock()
        for unit, seen in self.last_seen.items():
            if now - seen > self.config.heartbeat_timeout_s:
                hello = self.units[unit]
                raise CellLost(
                    f"cell {unit} (rank {hello.rank} on {hello.host}) silent for {now - seen:.0f} s"
                )
        got = self.channel.poll()
        if got is None:
            time.sleep(POLL_INTERVAL_S)
            return None
        if isinstance(got[1], Heartbeat):
            self.last_seen[got[1].cell] = now
            return None
        if isinstance(got[1], ev.EngineRestart):
            self.events.emit(got[1])  # recorded as it came
            return None
        return got[1]

    def receive(self) -> TrainDone | None:
        msg = self._next()
        if msg is not None and not isinstance(msg, TrainDone):
            raise ProtocolError(f"controller: unexpected {msg!r}")
        if msg is not None:
            self.hours.add_computed(msg.cell, msg.computed)
        return msg

    def _await(self, want: Callable[[Message], bool], timeout: float, what: str) -> Message:
        """The next message ``want`` accepts; others are kept for ``receive``."""
        deadline = self.clock() + timeout
        kept: list[Message] = []
        try:
            while True:
                msg = self._next()
                if msg is not None:
                    if want(msg):
                        return msg
                    kept.append(msg)
                elif self.clock() > deadline:
                    raise ProtocolError(f"controller: no {what} within {timeout:g} s")
        finally:
            self.inbox.extend(kept)

    # ---- verbs ----------------------------------------------------------------------------------

    def start(self) -> None:
        missing = set(range(self.layout.units))
        while missing:
            msg = self._await(
                lambda m: isinstance(m, Hello), self.waits.hello_s, f"Hello from {sorted(missing)}"
            )
            assert isinstance(msg, Hello)
            self.units[msg.cell] = msg
            self.roles[msg.cell] = Role.IDLE
            self.hours.mark(msg.cell, "idle", self.clock())
            self.last_seen[msg.cell] = self.clock()
            missing.discard(msg.cell)
            self.events.emit(msg)  # the message, recorded as it came

    def switch(self, roles: dict[int, Role]) -> dict[int, float]:
        pending: dict[int, int] = {}
        for cell, role in roles.items():
            if self.roles.get(cell) == role:
                continue
            self._seq += 1
            pending[cell] = self._seq
            self.channel.send(TakeRole(cell=cell, role=role, seq=self._seq), self.layout.leader(cell))
            self.events.emit(ev.SwitchRole(cell=cell, role=str(role), seq=self._seq))
            self.hours.mark(cell, "switching", self.clock())
        seconds = {}
        while pending:
            msg = self._await(
                lambda m: isinstance(m, RoleTaken) and pending.get(m.cell) == m.seq,
                self.waits.reply_s,
                f"RoleTaken from cells {sorted(pending)}",
            )
            assert isinstance(msg, RoleTaken)
            del pending[msg.cell]
            self.roles[msg.cell] = msg.role
            self.hours.mark(msg.cell, str(msg.role), self.clock())
            seconds[msg.cell] = msg.seconds
            self.events.emit(
                ev.RoleSwitched(cell=msg.cell, role=str(msg.role), seq=msg.seq, seconds=round(msg.seconds, 6))
            )
        return seconds

    def load_weights(self, units: list[int]) -> float:
        if not units:
            return 0.0
        version = self.version
        for unit in units:
            self.channel.send(LoadWeights(cell=unit, version=version), self.layout.leader(unit))
            self.hours.mark(unit, "switching", self.clock())
        pending, slowest, pushed = set(units), 0.0, Pushed()
        while pending:
            msg = self._await(
                lambda m: isinstance(m, Loaded) and m.version == version and m.cell in pending,
                self.waits.reply_s,
                f"Loaded from {sorted(pending)}",
            )
            assert isinstance(msg, Loaded)
            pending.discard(msg.cell)
            self.hours.mark(msg.cell, str(self.roles[msg.cell]), self.clock())
            slowest = max(slowest, msg.seconds)
            pushed += msg.pushed
        changed = pushed.changed_fraction
        self.loads.bytes += pushed.sent
        self.loads.seconds += slowest
        self.events.emit(
            ev.WeightsLoaded(
                version=version,
                units=units,
                seconds=round(slowest, 4),
                bytes=pushed.sent,
                whole_bytes=pushed.whole,
                changed=None if changed is None else round(changed, 6),
            )
        )
        return slowest

    def train(self, cells: list[int], step: int, queue: StepQueue, closed: bool) -> None:
        for cell in cells:
            self.channel.send(
                TrainStep(step=step, version=self.version, queue=list(queue), closed=closed),
                self.layout.leader(cell),
            )

    def extend(self, cells: list[int], step: int, items: StepQueue) -> None:
        for cell in cells:
            self.channel.send(MicroSteps(step=step, items=items), self.layout.leader(cell))

    def close_queue(self, cells: list[int], step: int, total: int, stop: bool) -> None:
        for cell in cells:
            self.channel.send(CloseQueue(step=step, total=total, stop=stop), self.layout.leader(cell))

    def reset_claims(self) -> None:
        self.transport.reset_counter()

    def claimed(self) -> int:
        return self.transport.claimed()

    def apply(
        self, step: int, done: dict[int, TrainDone], num_runs: int, checkpoint: bool, state: dict
    ) -> StepApplied:
        contributors = [self.layout.leader(c) for c, d in done.items() if c != 0 and d.claimed]
        self.channel.send(
            ApplyStep(
                step=step, contributors=contributors, num_runs=num_runs, checkpoint=checkpoint, state=state
            ),
            self.layout.leader(0),
        )
        # Summing, stepping and checkpointing take as long as the model makes them: the core
        # beats meanwhile, so it is waited for while it beats and lost when it falls silent.
        msg = self._await(lambda m: isinstance(m, StepApplied) and m.step == step, math.inf, "StepApplied")
        assert isinstance(msg, StepApplied)
        self.hours.add_computed(0, msg.seconds)  # the core sums, steps and publishes
        self.version = msg.version
        return msg

    def shutdown(self, reason: str) -> None:
        for unit in range(self.layout.units):
            self.channel.send(Goodbye(reason=reason), self.layout.leader(unit))
        self.events.emit(ev.Shutdown(reason=reason))
        self.channel.flush(self.config.heartbeat_timeout_s)
        wait_barrier(self.comm, self.config.heartbeat_timeout_s)
