"""A cell: a fixed group of ranks holding one model replica; its leader talks to the controller.

```
   IDLE ──SwitchRole──▶ SAMPLING ◀──SwitchRole──▶ TRAINING
     │                   │ engine serves            │ engine paused; TrainStep → claim
     │                   │ LoadWeights → pull v     │ micro-steps; core: ApplyStep → v+1
     └──────── Shutdown ─┴──────── Shutdown ────────┘
```

The engine is one replica per tensor-parallel group of the cell's GPUs (``placement``),
each hosted by the rank at its first GPU: the leader hosts replica 0 (an HTTP server the proxy
calls) and the trainer; the members follow role switches and weight loads, each with the replica
it hosts. The torch backend computes on the leader; a megatron trainer spans every rank
of its cell (tensor-, pipeline- and data-parallel), and the members mirror each trainer verb
the leader calls (``runtime.replica``). Cell 0 — the core — owns the optimizer, publishes every
version through the transport and writes checkpoints. A cell knows nothing about the schedule.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gyre_hpc.engines.hosted import HostedEngine, host_engine, resolve_device
from gyre_hpc.engines.sglang import Span, free_port
from gyre_hpc.layout import CONTROLLER
from gyre_hpc.placement import EnginePart, EnginePlan, engine_plan, replica_capacity
from gyre_hpc.pushed import Pushed
from gyre_hpc.recipe.schema import CellsConfig, EngineConfig, TrainerConfig
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    ApplyStep,
    Channel,
    CloseQueue,
    EnginesUp,
    EngineVerb,
    Heartbeat,
    Hello,
    LoadWeights,
    Message,
    MicroSteps,
    Mirror,
    ProtocolError,
    RoleSwitched,
    Shutdown,
    StepApplied,
    SwitchRole,
    TrainDone,
    TrainStep,
    WeightsLoaded,
    wait_barrier,
)
from gyre_hpc.runtime.replica import MirroredTrainer, mirror
from gyre_hpc.runtime.world import World
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.base import ApplyStats, Trainer
from gyre_hpc.trainer.data_parallel import Claims, apply_on_core, pull_snapshot, work_once
from gyre_hpc.trainer.emulated import EmulatedTrainer
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.transport.base import Transport

log = logging.getLogger(__name__)


def hand_over(trainer: Trainer | None, role: Role) -> None:
    """A rank's trainer's part of a role switch: its GPU memory handed back to sample, taken
    back to train (nothing for a rank without a trainer, or for another role)."""
    if trainer is None:
        return
    if role == Role.SAMPLING:
        trainer.release_memory()
    elif role == Role.TRAINING:
        trainer.resume_memory()


def rendezvous_timeout_s(engine: EngineConfig, cells: CellsConfig) -> float:
    """How long a replica's ranks wait for each other when they build their trainer: the
    members come at once, the leader only once its engine is up, which ``engine.start_timeout_s``
    bounds (a real 8B server with graph capture can take longer than torch's 300 s default)."""
    return engine.start_timeout_s + cells.heartbeat_timeout_s


def engine_dir(unit: int, part: EnginePart) -> str:
    """Where a part keeps its log: ``unit-0``, ``unit-0-replica-1``, ``unit-0-part-1`` (a part
    across nodes that is not its replica's head: emulated nodes share one file system)."""
    name = f"unit-{unit}" if part.replica == 0 else f"unit-{unit}-replica-{part.replica}"
    return name if part.node_rank == 0 else f"{name}-part-{part.node_rank}"


@dataclass(frozen=True)
class CellSetup:
    """What a cell needs besides its own config sections."""

    model_dir: Path
    checkpoints: Path
    transport: Transport
    engines: Path
    """Where engine processes keep their logs and weights on disk (``unit-<n>/``)."""
    packing: str = "tree"
    """How the trainer forwards a micro-step (``trajectory.packing``)."""
    nodes_per_cell: int = 1
    """The nodes a cell spans (``slurm.nodes_per_cell``): where its engine replicas go."""


@dataclass
class Session:
    """This cell's part in one step's training."""

    step: int
    claims: Claims
    started: float


class Cell:
    def __init__(
        self,
        world: World,
        cells: CellsConfig,
        engine: EngineConfig,
        trainer: TrainerConfig,
        setup: CellSetup | None,
    ) -> None:
        assert world.unit is not None
        self.world, self.cells, self.engine_cfg, self.trainer_cfg = world, cells, engine, trainer
        self.setup = setup
        self.unit: int = world.unit
        self.role = Role.IDLE
        self.to_controller = Channel(world.comm)
        self.in_cell = Channel(world.cell_comm)
        self.session: Session | None = None
        self.trained_step = -1
        self.megatron = None  # a MegatronWorld: this rank's place in its replica's torch.distributed world
        self.engine: HostedEngine | None = None
        self.scratch_version = 0

    @property
    def spread(self) -> bool:
        """The replica spans every rank of the cell, so the members compute too."""
        return self.megatron is not None and self.megatron.size > 1

    @property
    def is_core(self) -> bool:
        return self.unit == 0

    def run(self) -> None:
        if self.trainer_cfg.backend == "megatron" and not self.world.layout.is_standalone(self.unit):
            self.megatron = self._megatron_world()
        self.part, self.span = self._engine_part()
        try:
            if self.world.is_leader:
                self.start_replica()
                self.lead()
            else:
                self.follow()
        finally:
            if self.engine is not None:
                self.engine.stop()
        for channel in (self.to_controller, self.in_cell):
            channel.flush(self.cells.heartbeat_timeout_s)
        wait_barrier(self.world.comm, self.cells.heartbeat_timeout_s)

    def _engine_part(self) -> tuple[EnginePart | None, Span | None]:
        """The engine part this rank hosts, if any, and its place in a replica across nodes
        (``self.plan``: the cell's, the same on every rank). A replica across nodes takes one
        collective here, while every rank is present: each rank's node and a port free there."""
        comm, env, tp = self.world.cell_comm, self.world.env, self.engine_cfg.tp_size
        if self.world.layout.is_standalone(self.unit):
            self.plan = EnginePlan((EnginePart(0, 0, 0, env.gpu, tp),), 0)
            return self.plan.parts[0], None
        assert self.setup is not None
        self.plan = plan = engine_plan(comm.Get_size(), self.setup.nodes_per_cell, tp)
        mine = plan.hosted_by(comm.Get_rank())
        if all(p.nnodes == 1 for p in plan.parts):
            return (mine[0] if mine else None), None
        offers = comm.allgather((env.hostname, free_port(env.hostname)))
        if not mine:
            return None, None
        part = mine[0]
        head = next(p for p in plan.parts if p.replica == part.replica and p.head)
        host, port = offers[head.host_rank]
        return part, Span(part.nnodes, part.node_rank, f"{host}:{port}")

    def start_engine(self) -> str | None:
        """Start the engine part this rank hosts; the URL it serves at (None: it hosts none, or
        a part that serves no HTTP)."""
        assert self.setup is not None
        s, env, part = self.setup, self.world.env, self.part
        self.scratch = np.empty(s.transport.plan.params, dtype=np.float32)  # pulled snapshots land here
        if part is None:
            return None
        slurm = env.launcher == "slurm"
        self.engine = host_engine(
            self.engine_cfg,
            s.model_dir,
            replica_capacity(self.cells.capacity, self.plan.replicas),
            "0.0.0.0" if slurm else "127.0.0.1",
            s.engines / engine_dir(self.unit, part),
            env.gpu,
            self.newest_weights,
            self.span,
            env.hostname if self.span is not None else "127.0.0.1",
        )
        port = self.engine.start()
        if self.span is not None and not self.span.head:
            return None
        return f"http://{env.hostname if slurm else '127.0.0.1'}:{port}"

    def start_replica(self) -> None:
        assert self.setup is not None
        s = self.setup
        own = self.start_engine()
        self.addresses = self._gather_addresses(own)
        if self.world.layout.is_standalone(self.unit):
            self.trainer = None
            return
        trainer = self._trainer_class()(
            s.model_dir,
            self.trainer_cfg,
            core=self.is_core,
            grad_buffer=None if self.is_core else s.transport.gradient_buffer(),
            packing=s.packing,
            **({"world": self.megatron} if self.megatron is not None else {"device": self._torch_device()}),
        )
        self.trainer = (
            MirroredTrainer(trainer, self.world.cell_comm, self.in_cell) if self.spread else trainer
        )
        if self.is_core:
            last, _ = checkpoint.newest_intact(s.checkpoints)  # the controller reports the skipped
            if last is not None:
                info = checkpoint.restore(last, self.trainer)
                log.info("core: resumed from %s (step %s, version %s)", last, info["step"], info["version"])
            s.transport.publish(self.trainer.weights(), self.trainer.version)

    def _torch_device(self) -> str:
        """Where a torch trainer computes: ``trainer.device``, auto being this rank's GPU if any."""
        device = resolve_device(self.trainer_cfg.device)
        if device == "cuda":
            return f"cuda:{self.world.env.gpu % torch.cuda.device_count()}"
        return device

    def _trainer_class(self) -> type:
        backend = self.trainer_cfg.backend
        if backend == "megatron":
            from gyre_hpc.trainer.megatron_backend import MegatronTrainer  # needs megatron-core

            return MegatronTrainer
        return EmulatedTrainer if backend == "emulated" else TorchTrainer

    def _megatron_world(self):  # noqa: ANN202 - a MegatronWorld (megatron-core is optional)
        """Collective over the cell: the leader picks where the rendezvous store listens."""
        from gyre_hpc.trainer.megatron_backend import MegatronWorld, free_port

        comm, env = self.world.cell_comm, self.world.env
        host = env.hostname if env.launcher == "slurm" else "127.0.0.1"
        host, port = comm.bcast((host, free_port(host)) if comm.Get_rank() == 0 else None, root=0)
        wait = rendezvous_timeout_s(self.engine_cfg, self.cells)
        return MegatronWorld(comm.Get_rank(), comm.Get_size(), host, port, gpu=env.gpu, timeout_s=wait)

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
                self.unit,
                self.world.rank,
                self.world.env.node_name,
                os.getpid(),
                self.addresses,
                self.cells.capacity,
                layout.is_standalone(self.unit),
            ),
            CONTROLLER,
        )
        next_beat = 0.0
        deferred: list[Message] = []  # engine verbs that wait for a restarting engine
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self.to_controller.send(Heartbeat(self.unit, self.role, time.time()), CONTROLLER)
                next_beat = now + self.cells.heartbeat_s
            self.engine.supervise()
            if deferred and not self.engine.restarting:
                got: tuple[int, Message] | None = (CONTROLLER, deferred.pop(0))
            else:
                got = self.to_controller.poll(CONTROLLER)
            if got is None:
                if self.session is None or not self.work_once():
                    time.sleep(POLL_INTERVAL_S)
                continue
            msg = got[1]
            if isinstance(msg, SwitchRole | LoadWeights) and (self.engine.restarting or deferred):
                deferred.append(msg)  # in order, once the engine is back (heartbeats go on meanwhile)
                continue
            if isinstance(msg, Shutdown):
                self._forward(msg)
                log.info("cell %d: shutdown (%s)", self.unit, msg.reason)
                return
            started = time.monotonic()
            if isinstance(msg, SwitchRole):
                self.switch(msg)
                seconds = time.monotonic() - started
                self.to_controller.send(RoleSwitched(self.unit, msg.role, msg.seq, seconds), CONTROLLER)
                log.info("cell %d: role %s (%.3f s)", self.unit, msg.role, seconds)
            elif isinstance(msg, LoadWeights):
                pushed = self.load_weights(msg.version)
                self.to_controller.send(
                    WeightsLoaded(self.unit, msg.version, time.monotonic() - started, pushed), CONTROLLER
                )
            elif isinstance(msg, TrainStep):
                self.session = self.open_session(msg)
            elif isinstance(msg, MicroSteps):
                self.session.claims.queue += msg.items
            elif isinstance(msg, CloseQueue):
                self.session.claims.close(msg.total, msg.stop)
            elif isinstance(msg, ApplyStep):
                self.to_controller.send(self.apply(msg, started), CONTROLLER)
            else:
                raise ProtocolError(f"cell {self.unit}: unexpected {msg!r}")

    def switch(self, msg: SwitchRole) -> None:
        """The GPUs change hands in an order that never needs both at once: to sample, every
        rank's trainer lets go before any engine replica resumes; to train, every replica lets
        go before any trainer takes its memory back."""
        if self.session is not None:
            raise ProtocolError(f"cell {self.unit}: role switch while training step {self.session.step}")
        if msg.role == Role.TRAINING:
            self._engines("pause", msg.seq)  # the proxy drained them first: nothing is left in flight
        elif msg.role == Role.SAMPLING and self.trainer is not None and self.is_core:
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
            self.in_cell.send(EngineVerb(verb, seq), rank)
        for rank in hosts:
            _, ack = self.in_cell.recv(
                self.cells.heartbeat_timeout_s, rank, f"{verb} from cell member {rank}"
            )
            if ack != EngineVerb(verb, seq):
                raise ProtocolError(f"cell {self.unit}: member {rank} answered {ack!r}")
        getattr(self.engine, verb)()

    def load_weights(self, version: int) -> Pushed:
        """Every replica of the cell loads ``version``: the members hosting one at once (each
        pulls the snapshot itself), the leader's own meanwhile; what they moved, together."""
        hosts = self._hosting_members()
        for rank in hosts:
            self.in_cell.send(LoadWeights(self.unit, version), rank)
        if self.trainer is not None and self.is_core:
            pushed = self.engine.load(self.trainer.weights(), version)
        else:
            pushed = self.load_pulled(version)
        wait = self.engine_cfg.start_timeout_s + self.cells.heartbeat_timeout_s  # a restarting replica
        for rank in hosts:
            _, ack = self.in_cell.recv(wait, rank, f"WeightsLoaded from cell member {rank}")
            if not (isinstance(ack, WeightsLoaded) and ack.version == version):
                raise ProtocolError(f"cell {self.unit}: member {rank} answered {ack!r}")
            pushed += ack.pushed
        return pushed

    def load_pulled(self, version: int) -> Pushed:
        """The core's snapshot ``version`` into this rank's engine part."""
        got = self.setup.transport.pull_snapshot(self.scratch)
        if got != version:
            raise ProtocolError(f"cell {self.unit}: snapshot holds version {got}, expected {version}")
        self.scratch_version = got
        return self.engine.load(self.scratch, version)

    def _hosting_members(self) -> list[int]:
        """The members that host an engine part taking weights (heads: a part across nodes gets
        them from its head's weight group)."""
        return sorted({p.host_rank for p in self.plan.parts if p.head and p.host_rank != 0})

    def newest_weights(self) -> tuple[np.ndarray, int]:
        """What a restarted engine loads: the newest weights this cell holds (a copy, taken when
        the engine was found dead)."""
        if self.trainer is not None and self.is_core:
            return self.trainer.weights().copy(), self.trainer.version
        return self.scratch.copy(), self.scratch_version

    def open_session(self, msg: TrainStep) -> Session:
        """Join a step: its snapshot, a zero gradient, then claim micro-steps (``work_once``)."""
        assert self.trainer is not None, "a standalone engine never trains"
        if self.trainer.version != msg.version:
            if self.is_core:
                raise ProtocolError(f"core holds version {self.trainer.version}, asked for {msg.version}")
            pull_snapshot(self.trainer, self.setup.transport, msg.version, self.scratch)
            self.scratch_version = msg.version
        self.trainer.zero_grad()
        self.trained_step = msg.step
        return Session(msg.step, Claims.of(msg.queue, msg.closed), time.monotonic())

    def work_once(self) -> bool:
        """One claim or one micro-step of the open session; False while waiting for data."""
        s = self.session
        assert s is not None and self.trainer is not None
        state = work_once(s.claims, self.trainer, self.setup.transport)
        if state == "done":
            c = s.claims
            clipped = sum(x.clipped for x in c.stats)
            seconds = time.monotonic() - s.started
            done = TrainDone(self.unit, s.step, c.claimed, c.loss_sum, c.tokens, clipped, seconds)
            self.to_controller.send(done, CONTROLLER)
            self.session = None
        return state != "waiting"

    def apply(self, msg: ApplyStep, started: float) -> StepApplied:
        assert self.is_core and self.trainer is not None
        if self.trained_step != msg.step:  # the core took no part in this step: no own gradient
            self.trainer.zero_grad()
        if msg.num_runs == 0:  # nothing to learn from this step: same version, still checkpointed
            stats = ApplyStats(self.trainer.version, 0.0)
        else:
            stats = apply_on_core(
                self.trainer, self.setup.transport, msg.contributors, msg.num_runs, self.scratch
            )
        saved = ""
        if msg.checkpoint:
            saved = str(
                checkpoint.save(
                    self.setup.checkpoints, msg.step, self.trainer, self.setup.model_dir, **msg.state
                )
            )
        return StepApplied(msg.step, stats.version, stats.grad_norm, time.monotonic() - started, saved)

    def follow(self) -> None:
        url = self.start_engine()
        if url is not None:
            self.in_cell.send(EnginesUp(self.world.cell_comm.Get_rank(), {self.part.replica: url}), 0)
        trainer = self._member_trainer() if self.spread else None
        while True:
            # No timeout: a leader that dies takes the job down, one that hangs is caught by the
            # controller's heartbeat check. Between messages, the hosted engine is supervised.
            got = self.in_cell.poll(0)
            if got is None:
                if self.engine is not None:
                    self.engine.supervise()
                time.sleep(POLL_INTERVAL_S)
                continue
            msg = got[1]
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, SwitchRole):
                # Acknowledged only once done: to sample, the engines resume after every
                # member's release; to train, the leader forwards this after they let go.
                hand_over(trainer, msg.role)
                self.role = msg.role
                self.in_cell.send(RoleSwitched(self.unit, msg.role, msg.seq, 0.0), 0)
            elif isinstance(msg, EngineVerb) and self.engine is not None:
                getattr(self.engine, msg.verb)()
                self.in_cell.send(msg, 0)
            elif isinstance(msg, LoadWeights) and self.engine is not None:
                started = time.monotonic()
                while self.engine.restarting:  # it comes back at the newest version it held
                    self.engine.supervise()
                    time.sleep(POLL_INTERVAL_S)
                pushed = self.load_pulled(msg.version)
                seconds = time.monotonic() - started
                self.in_cell.send(WeightsLoaded(self.unit, msg.version, seconds, pushed), 0)
            elif isinstance(msg, Mirror) and trainer is not None:
                mirror(trainer, msg, self.world.cell_comm, self.scratch)
            else:
                raise ProtocolError(f"cell {self.unit} member: unexpected {msg!r}")

    def _member_trainer(self):  # noqa: ANN202 - a MegatronTrainer
        """This member's part of the replica, built with the leader's (its construction is collective)."""
        from gyre_hpc.trainer.megatron_backend import MegatronTrainer

        assert self.setup is not None
        trainer = MegatronTrainer(
            self.setup.model_dir,
            self.trainer_cfg,
            core=self.is_core,
            world=self.megatron,
            packing=self.setup.packing,
        )
        if self.scratch.size != trainer.numel:
            self.scratch = np.empty(trainer.numel, dtype=np.float32)  # broadcast snapshots land here
        return trainer

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
