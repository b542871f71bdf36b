"""A cell's leader: the rank that talks to the controller for its cell (its states are drawn in
``runtime.cell``).

It says Hello with every replica's URL, beats its heart (between messages, and from a thread
of its own while a handler or a micro-step works), supervises its engine, and answers
each controller verb with one handler (``handlers``); between messages it trains the open
session one claim or micro-step at a time. It forwards role switches, engine verbs and weight
loads to its members (``runtime.cell_member``) and waits for their acknowledgements, so the GPUs
change hands in an order that never needs both at once. It knows nothing about the schedule.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.plan.ranks import CONTROLLER
from gyre_hpc.runtime.cell_host import CellHost, hand_over
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    ApplyStep,
    CloseQueue,
    EnginesUp,
    EngineVerb,
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
)
from gyre_hpc.runtime.replica import MirroredTrainer
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.step.claims import Claims, work_once
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.base import ApplyStats
from gyre_hpc.trainer.data_parallel import apply_on_core

log = logging.getLogger(__name__)


@dataclass
class StepTraining:
    """This cell's part in one step's training."""

    step: int
    claims: Claims
    started: float


class Leader(CellHost):
    """Rank 0 of a cell."""

    session: StepTraining | None = None
    trained_step = -1
    _working = False
    """Inside a handler or a micro-step: the heartbeat thread beats for the loop meanwhile."""

    @property
    def handlers(self) -> dict[type, Callable[[Any, float], None]]:
        """The controller's verbs (Goodbye ends ``lead`` itself)."""
        return {
            TakeRole: self.on_switch,
            LoadWeights: self.on_load,
            TrainStep: self.on_train_step,
            MicroSteps: self.on_micro_steps,
            CloseQueue: self.on_close_queue,
            ApplyStep: self.on_apply,
        }

    def start_replica(self) -> None:
        """Its engine part up, every replica's URL gathered, then the trainer (the core's
        restored and published)."""
        self.addresses = self._gather_addresses(self.start_engine())
        if self.world.layout.is_standalone(self.unit):
            return
        trainer = self.build_trainer()
        self.trainer = (
            MirroredTrainer(trainer, self.world.cell_comm, self.in_cell) if self.spread else trainer
        )
        if self.is_core:
            self.restore()

    def serve(self) -> None:
        self.start_replica()
        self.lead()

    def _gather_addresses(self, own: str | None) -> tuple[str, ...]:
        """Every replica's URL, in replica order: the leader's own, and each hosting member's
        (its EnginesUp comes once its engine is healthy: up to engine.start_timeout_s)."""
        assert own is not None, "the leader hosts replica 0's head"
        urls = {0: own}
        wait = self.engine_cfg.start_timeout_s + self.cells.heartbeat_timeout_s
        for rank in self._hosting_members():
            _, msg = self.in_cell.recv(wait, rank, f"EnginesUp from cell member {rank}")
            if not isinstance(msg, EnginesUp):
                raise ProtocolError(f"cell {self.unit}: member {rank} answered {msg!r}")
            urls.update(msg.addresses)
        return tuple(urls[r] for r in sorted(urls))

    def lead(self) -> None:
        layout = self.world.layout
        self.to_controller.send(
            Hello(
                cell=self.unit,
                rank=self.world.rank,
                host=self.world.env.node_name,
                pid=os.getpid(),
                addresses=self.addresses,
                capacity=self.cells.capacity,
                standalone=layout.is_standalone(self.unit),
            ),
            CONTROLLER,
        )
        next_beat = 0.0
        deferred: list[Message] = []  # engine verbs that wait for a restarting engine
        threading.Thread(target=self._beat_while_working, name="heartbeat", daemon=True).start()
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self.heartbeat()
                next_beat = now + self.cells.heartbeat_s
            self.engine.supervise()
            self.report_restarts()
            self.catch_up()
            if deferred and not self.engine.restarting:
                got: tuple[int, Message] | None = (CONTROLLER, deferred.pop(0))
            else:
                got = self.to_controller.poll(CONTROLLER)
            if got is None:
                if self.session is None or not self.working(self.work_once):
                    time.sleep(POLL_INTERVAL_S)
                continue
            msg = got[1]
            if isinstance(msg, TakeRole | LoadWeights) and (self.engine.restarting or deferred):
                deferred.append(msg)  # in order, once the engine is back (heartbeats go on meanwhile)
                continue
            if isinstance(msg, Goodbye):
                self._forward(msg)
                log.info("cell %d: shutdown (%s)", self.unit, msg.reason)
                return
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"cell {self.unit}: unexpected {msg!r}")
            self.working(handler, msg, time.monotonic())

    def catch_up(self) -> None:
        """A restarted engine that loads from the cell's slices waits, not generating, for the
        version the cell holds: streamed here, between messages, with every member taking part
        (the leader's own, and each a member says is waiting: ``EngineStale``)."""
        if not self.streams or self.trainer is None:
            return
        waiting = []
        if self.engine.wants is not None and self.engine.can_load:
            waiting.append(0)
        while (got := self.stale.poll()) is not None:
            waiting.append(got[0])
        if waiting:
            log.info("cell %d: restarted engines at cell ranks %s load version %d",
                     self.unit, waiting, self.trainer.version)  # fmt: skip
            self.working(self.load_streamed, self.trainer.version, tuple(sorted(set(waiting))))

    def heartbeat(self) -> None:
        self.to_controller.send(Heartbeat(cell=self.unit, role=self.role, sent=time.time()), CONTROLLER)

    def working(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)``, beating meanwhile from the heartbeat thread: an apply, a checkpoint, a
        weight load or a micro-step of a large model outlasts ``cells.heartbeat_timeout_s``, and
        a cell that works is not a lost one."""
        self._working = True
        try:
            return work(*args)
        finally:
            self._working = False

    def _beat_while_working(self) -> None:
        while True:
            time.sleep(self.cells.heartbeat_s)
            if self._working:
                self.heartbeat()

    # ---- the controller's verbs, one handler each ---------------------------------------------

    def on_switch(self, msg: TakeRole, started: float) -> None:
        self.switch(msg)
        seconds = time.monotonic() - started
        self.to_controller.send(
            RoleTaken(cell=self.unit, role=msg.role, seq=msg.seq, seconds=seconds), CONTROLLER
        )
        log.info("cell %d: role %s (%.3f s)", self.unit, msg.role, seconds)

    def on_load(self, msg: LoadWeights, started: float) -> None:
        pushed = self.load_weights(msg.version)
        seconds = time.monotonic() - started
        self.to_controller.send(
            Loaded(cell=self.unit, version=msg.version, seconds=seconds, pushed=pushed), CONTROLLER
        )

    def on_train_step(self, msg: TrainStep, started: float) -> None:
        self.session = self.open_session(msg)

    def on_micro_steps(self, msg: MicroSteps, started: float) -> None:
        assert self.session is not None, "micro-steps before their step"
        self.session.claims.queue += msg.items

    def on_close_queue(self, msg: CloseQueue, started: float) -> None:
        assert self.session is not None, "a queue closed before its step"
        self.session.claims.close(msg.total, msg.stop)

    def on_apply(self, msg: ApplyStep, started: float) -> None:
        self.to_controller.send(self.apply(msg, started), CONTROLLER)

    def switch(self, msg: TakeRole) -> None:
        """The GPUs change hands in an order that never needs both at once: to sample, every
        rank's trainer lets go before any engine replica resumes; to train, every replica lets
        go before any trainer takes its memory back."""
        if self.session is not None:
            raise ProtocolError(f"cell {self.unit}: role switch while training step {self.session.step}")
        if msg.role == Role.TRAINING:
            self._engines("pause", msg.seq)  # the proxy drained them first: nothing is left in flight
        elif msg.role == Role.SAMPLING and self.trainer is not None and self.is_core and not self.streams:
            self.trainer.weights()  # gathered while resident: the engine loads them once released
        self._forward(msg)
        self._await_members(msg.seq)
        hand_over(self.trainer, msg.role)
        if msg.role == Role.SAMPLING:
            self._engines("resume", msg.seq)
        self.role = msg.role

    def _engines(self, verb: str, seq: int) -> None:
        """Every replica of the cell paused or resumed: the members' first, then the leader's."""
        hosts = self._hosting_members()
        for rank in hosts:
            self.in_cell.send(EngineVerb(verb=verb, seq=seq), rank)
        for rank in hosts:
            _, ack = self.in_cell.recv(
                self.cells.heartbeat_timeout_s, rank, f"{verb} from cell member {rank}"
            )
            if ack != EngineVerb(verb=verb, seq=seq):
                raise ProtocolError(f"cell {self.unit}: member {rank} answered {ack!r}")
        getattr(self.engine, verb)()

    def load_weights(self, version: int) -> Pushed:
        """Every replica of the cell loads ``version``: the members hosting one at once (each
        pulls the snapshot itself), the leader's own meanwhile; what they moved, together.
        Where the engines stream from the cell's slices, every rank gathers them instead."""
        self.setup.faults.reach("push")
        if self.streams:
            return self.load_streamed(version, self.weight_hosts)
        hosts = [r for r in self.weight_hosts if r != 0]
        for rank in hosts:
            self.in_cell.send(LoadWeights(cell=self.unit, version=version), rank)
        if self.trainer is not None and self.is_core:
            pushed = self.load_engine(self.trainer.weights(), version)
        else:
            pushed = self.load_pulled(version)
        wait = self.engine_cfg.start_timeout_s + self.cells.heartbeat_timeout_s  # a restarting replica
        for rank in hosts:
            _, ack = self.in_cell.recv(wait, rank, f"Loaded from cell member {rank}")
            if not (isinstance(ack, Loaded) and ack.version == version):
                raise ProtocolError(f"cell {self.unit}: member {rank} answered {ack!r}")
            pushed += ack.pushed
        return pushed

    def load_streamed(self, version: int, hosts: tuple[int, ...]) -> Pushed:
        """The engines of ``hosts`` load ``version`` from the cell's slices (a satellite's pulled
        first), every rank taking part; what they moved, together."""
        assert self.trainer is not None
        if self.trainer.version != version:
            if self.is_core:
                raise ProtocolError(f"core holds version {self.trainer.version}, asked to load {version}")
            self.pull_weights(version)
        pushed = self.stream_into_engine(self.trainer, hosts, version)
        wait = self.engine_cfg.start_timeout_s + self.cells.heartbeat_timeout_s  # a restarting replica
        for rank in (h for h in hosts if h != 0):
            _, ack = self.in_cell.recv(wait, rank, f"Loaded from cell member {rank}")
            if not (isinstance(ack, Loaded) and ack.version == version):
                raise ProtocolError(f"cell {self.unit}: member {rank} answered {ack!r}")
            pushed += ack.pushed
        return pushed

    def _hosting_members(self) -> list[int]:
        """The members that host a replica's head (its URL, its verbs)."""
        return sorted({p.host_rank for p in self.plan.parts if p.head and p.host_rank != 0})

    def open_session(self, msg: TrainStep) -> StepTraining:
        """Join a step: its snapshot, a zero gradient, then claim micro-steps (``work_once``)."""
        assert self.trainer is not None, "a standalone engine never trains"
        if self.trainer.version != msg.version:
            if self.is_core:
                raise ProtocolError(f"core holds version {self.trainer.version}, asked for {msg.version}")
            self.pull_weights(msg.version)
        self.trainer.zero_grad()
        self.trained_step = msg.step
        return StepTraining(msg.step, Claims.of(msg.queue, msg.closed), time.monotonic())

    def work_once(self) -> bool:
        """One claim or one micro-step of the open session; False while waiting for data."""
        s = self.session
        assert s is not None and self.trainer is not None
        state = work_once(s.claims, self.trainer, self.setup.transport)
        if state == "done":
            done = TrainDone.of(self.unit, s.step, s.claims, time.monotonic() - s.started)
            self.to_controller.send(done, CONTROLLER)
            self.session = None
        return state != "waiting"

    def apply(self, msg: ApplyStep, started: float) -> StepApplied:
        assert self.is_core and self.trainer is not None
        faults = self.setup.faults
        faults.reach("apply")
        if self.trained_step != msg.step:  # the core took no part in this step: no own gradient
            self.trainer.zero_grad()
        if msg.num_runs == 0:  # nothing to learn from this step: same version, still checkpointed
            stats = ApplyStats(self.trainer.version, 0.0)
        else:
            add = self.trainer.add_gradients if isinstance(self.trainer, MirroredTrainer) else None
            stats = apply_on_core(self.trainer, self.setup.transport, msg.contributors, msg.num_runs, add)
            self.publish_slices()
        faults.reach("publish")
        saved = ""
        if msg.checkpoint:
            saved = str(
                checkpoint.save(
                    self.setup.checkpoints, msg.step, self.trainer, self.setup.model_dir,
                    written=lambda: faults.reach("checkpoint"), export=self._exports(msg.step), **msg.state,
                )
            )  # fmt: skip
        return StepApplied(
            step=msg.step,
            version=stats.version,
            grad_norm=stats.grad_norm,
            seconds=time.monotonic() - started,
            checkpoint=saved,
        )

    def _exports(self, step: int) -> bool:
        every = self.trainer_cfg.export_every
        return bool(every) and step % every == 0

    def _forward(self, msg: TakeRole | Goodbye) -> None:
        for member in range(1, self.world.cell_comm.Get_size()):
            self.in_cell.send(msg, member)

    def _await_members(self, seq: int) -> None:
        for member in range(1, self.world.cell_comm.Get_size()):
            _, ack = self.in_cell.recv(
                self.cells.heartbeat_timeout_s, member, f"ack from cell member {member}"
            )
            if not (isinstance(ack, RoleTaken) and ack.seq == seq):
                raise ProtocolError(f"cell {self.unit}: member {member} answered {ack!r}")
