"""A cell's member: a rank other than the leader, following what its leader forwards.

```
 leader ──TakeRole────▶ member: its trainer's memory handed over, then acknowledged (RoleTaken)
        ──EngineVerb──▶ its engine part paused or resumed, acknowledged
        ──LoadWeights─▶ its engine part pulls the core's snapshot, Loaded
        ──Mirror──────▶ its part of a megatron trainer's collective verb (``runtime.replica``)
        ──Goodbye─────▶ done
```

Each verb has one handler (``handlers``). It never talks to the controller: a leader that dies
takes the job down, one that hangs is caught by the controller's heartbeat check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gyre_hpc.runtime.cell_host import CellHost, hand_over
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    EngineStale,
    EnginesUp,
    EngineVerb,
    Goodbye,
    Loaded,
    LoadWeights,
    Message,
    Mirror,
    ProtocolError,
    RoleTaken,
    TakeRole,
)
from gyre_hpc.runtime.replica import mirror


class Member(CellHost):
    """A rank of a cell other than 0."""

    mirrored = None
    """Its part of a megatron trainer spread over the cell (``self.trainer`` stays the leader's
    concern: a member's engine part loads pulled snapshots, never a trainer's weights)."""

    @property
    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """The leader's verbs (Goodbye ends ``serve`` itself)."""
        return {
            TakeRole: self.on_switch,
            EngineVerb: self.on_engine_verb,
            LoadWeights: self.on_load,
            Mirror: self.on_mirror,
        }

    def serve(self) -> None:
        url = self.start_engine()
        if url is not None:
            self.in_cell.send(
                EnginesUp(rank=self.world.cell_comm.Get_rank(), addresses={self.part.replica: url}), 0
            )
        self.mirrored = self._member_trainer() if self.spread else None
        while True:
            # No timeout: a leader that dies takes the job down, one that hangs is caught by the
            # controller's heartbeat check. Between messages, the hosted engine is supervised.
            got = self.in_cell.poll(0)
            if got is None:
                if self.engine is not None:
                    self.engine.supervise()
                    self.report_restarts()
                    self.say_stale()
                time.sleep(POLL_INTERVAL_S)
                continue
            msg = got[1]
            if isinstance(msg, Goodbye):
                return
            handler = self.handlers.get(type(msg))
            if handler is None or (handler != self.on_switch and not self.can(msg)):
                raise ProtocolError(f"cell {self.unit} member: unexpected {msg!r}")
            handler(msg)

    def can(self, msg: Message) -> bool:
        """Engine verbs and loads need an engine part here, mirrored trainer verbs a trainer."""
        return self.mirrored is not None if isinstance(msg, Mirror) else self.engine is not None

    # ---- the leader's verbs, one handler each ---------------------------------------------------

    def on_switch(self, msg: TakeRole) -> None:
        # Acknowledged only once done: to sample, the engines resume after every member's
        # release; to train, the leader forwards this after they let go.
        hand_over(self.mirrored, msg.role)
        self.role = msg.role
        self.in_cell.send(RoleTaken(cell=self.unit, role=msg.role, seq=msg.seq, seconds=0.0), 0)

    def on_engine_verb(self, msg: EngineVerb) -> None:
        getattr(self.engine, msg.verb)()
        self.in_cell.send(msg, 0)

    def on_load(self, msg: LoadWeights) -> None:
        assert self.engine is not None
        started = time.monotonic()
        while self.engine.restarting:  # it comes back at the newest version it held
            self.engine.supervise()
            time.sleep(POLL_INTERVAL_S)
        pushed = self.load_pulled(msg.version)
        seconds = time.monotonic() - started
        self.in_cell.send(Loaded(cell=self.unit, version=msg.version, seconds=seconds, pushed=pushed), 0)

    def on_mirror(self, msg: Mirror) -> None:
        if msg.verb == "hf_tensors" and self.world.cell_comm.Get_rank() in msg.args[0]:
            self.on_stream(*msg.args)
            return
        mirror(self.mirrored, msg, self.world.cell_comm, self.setup.transport)

    def on_stream(self, hosts: tuple[int, ...], version: int) -> None:
        """Its engine loads ``version`` as the cell streams it from its slices; acknowledged."""
        started = time.monotonic()
        pushed = self.stream_into_engine(self.mirrored, hosts, version)
        self.told_stale = False
        seconds = time.monotonic() - started
        self.in_cell.send(Loaded(cell=self.unit, version=version, seconds=seconds, pushed=pushed), 0)

    told_stale = False
    """This rank's restarted engine waits for the cell's weights, and the leader knows."""

    def say_stale(self) -> None:
        """A restarted engine that waits for the cell's weights: the leader is told, once."""
        wants = self.engine.wants
        if wants is not None and self.streams and self.engine.can_load and not self.told_stale:
            self.stale.send(EngineStale(rank=self.world.cell_comm.Get_rank(), version=wants), 0)
            self.told_stale = True

    def _member_trainer(self):  # noqa: ANN202 - a MegatronTrainer
        """This member's part of the replica, built with the leader's (its construction is collective)."""
        from gyre_hpc.trainer.megatron_backend import MegatronTrainer

        assert self.setup is not None
        return MegatronTrainer(
            self.setup.model_dir,
            self.trainer_cfg,
            core=self.is_core,
            grad_buffer=self.exposed_gradient(),
            world=self.megatron,
            packing=self.setup.packing,
        )
