"""How a cell hosts its engine part and its trainer: what every rank of a cell holds.

```
 rank ──▶ its engine part (placement: one replica per tensor-parallel group, hosted by the rank
 │        at its first GPU; a replica across nodes spans ranks on several nodes)
 └──────▶ its trainer (the leader's, or with megatron every rank's part of the replica)
          core (cell 0): restores the newest intact checkpoint and publishes version 0 or it
```

A rank's GPU memory changes hands between the two on a role switch (``hand_over``). This module
knows nothing of messages to the controller or to the other ranks (``runtime.cell_leader``,
``runtime.cell_member``) or of the schedule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre_hpc.engines.hosted import HostedEngine, host_engine, resolve_device
from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.engines.sglang import Span
from gyre_hpc.engines.staging import Tensors
from gyre_hpc.faults.points import FaultPoints
from gyre_hpc.launch.ports import free_port
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.observability.events import EngineRestart
from gyre_hpc.plan.placement import EnginePart, EnginePlan, engine_plan, replica_capacity
from gyre_hpc.plan.ranks import CONTROLLER
from gyre_hpc.recipe.schema import CellsConfig, EngineConfig, TrainerConfig
from gyre_hpc.rundir import engine_part_dir
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    STALE_TAG,
    Channel,
    ProtocolError,
)
from gyre_hpc.runtime.replica import MirroredTrainer
from gyre_hpc.runtime.span import HeadSpan, PartSpan
from gyre_hpc.runtime.world import World
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.trainer import checkpoint
from gyre_hpc.trainer.base import Trainer
from gyre_hpc.trainer.data_parallel import publish_slice, pull_slice, pull_snapshot
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
    faults: FaultPoints = FaultPoints()
    """Where a test makes this rank die (``GYRE_FAULT``); none in a real run."""


class CellHost:
    """A rank of a cell with what it hosts; ``Leader`` and ``Member`` add their loops."""

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
        self.stale = Channel(world.cell_comm, STALE_TAG)
        """Members' restarted engines that wait for the cell to stream them its weights."""
        self.megatron = None  # a MegatronWorld: this rank's place in its replica's torch.distributed world
        self.engine: HostedEngine | None = None
        self.trainer: Trainer | None = None
        self.scratch_version = 0

    @property
    def spread(self) -> bool:
        """The replica spans every rank of the cell, so the members compute too."""
        return self.megatron is not None and self.megatron.size > 1

    @property
    def is_core(self) -> bool:
        return self.unit == 0

    def place(self) -> None:
        """Collective over the cell, on every rank at once: the megatron rendezvous, then this
        rank's engine part."""
        if self.trainer_cfg.backend == "megatron" and not self.world.layout.is_standalone(self.unit):
            self.megatron = self._megatron_world()
        self.part, self.span = self._engine_part()

    def serve(self) -> None:
        """This rank's loop (``Leader.lead``, ``Member.follow``) until Goodbye."""
        raise NotImplementedError

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
        # Pulled snapshots land here: an engine part's, and a satellite leader's (its trainer's).
        # The core's leader loads its trainer's own weights; a member that hosts no engine part
        # holds no whole-model buffer.
        leads = self.world.cell_comm.Get_rank() == 0
        pulls = (part is not None or leads) and not (leads and self.is_core)
        whole = s.transport.plan.params if pulls else 0
        self.scratch = np.empty(whole, dtype=np.float32)
        if part is None:
            return None
        slurm = env.launcher == "slurm"
        peers = self._span_peers(part)
        self.span_head = peers if isinstance(peers, HeadSpan) else None
        self.engine = host_engine(
            self.engine_cfg,
            s.model_dir,
            replica_capacity(self.cells.capacity, self.plan.replicas),
            "0.0.0.0" if slurm else "127.0.0.1",
            engine_part_dir(s.engines, self.unit, part.replica, part.node_rank),
            env.gpu,
            self.newest_weights,
            self.span,
            env.hostname if self.span is not None else "127.0.0.1",
            peers,
            routes=self.trainer_cfg.routing_replay and bool(ModelConfig.load(s.model_dir).num_experts),
        )
        port = self.engine.start()
        if self.span is not None and not self.span.head:
            return None
        return f"http://{env.hostname if slurm else '127.0.0.1'}:{port}"

    span_head: HeadSpan | None = None
    """This rank heads a replica across nodes whose other parts stage its weights too."""

    def _span_peers(self, part: EnginePart) -> HeadSpan | PartSpan | None:
        """Where a replica across nodes takes its weights by reference, the other parts this
        rank's part meets for each bucket (``runtime.span``)."""
        if self.span is None or self.engine_cfg.weight_sync != "tensor":
            return None
        comm, ranks = self.world.cell_comm, [p.host_rank for p in self.plan.parts_of(part.replica)]
        wait = self.engine_cfg.start_timeout_s + self.cells.heartbeat_timeout_s  # a head may be restarting
        return HeadSpan(comm, ranks[1:], wait) if self.span.head else PartSpan(comm, ranks[0], wait)

    @property
    def weight_hosts(self) -> tuple[int, ...]:
        """The cell ranks whose engine parts load each version (every part of a replica across
        nodes, where they go by reference)."""
        return self.plan.weight_hosts(by_reference=self.engine_cfg.weight_sync == "tensor")

    def load_engine(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        """This rank's engine part loads ``weights`` as ``version``; the head of a replica across
        nodes then tells its other parts the load is over, whatever became of it."""
        assert self.engine is not None
        try:
            return self.engine.load(weights, version)
        finally:
            if self.span_head is not None:
                self.span_head.end(version)

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
        from gyre_hpc.trainer.megatron_backend import MegatronWorld

        comm, env = self.world.cell_comm, self.world.env
        host = env.hostname if env.launcher == "slurm" else "127.0.0.1"
        host, port = comm.bcast((host, free_port(host)) if comm.Get_rank() == 0 else None, root=0)
        wait = rendezvous_timeout_s(self.engine_cfg, self.cells)
        return MegatronWorld(comm.Get_rank(), comm.Get_size(), host, port, gpu=env.gpu, timeout_s=wait)

    def build_trainer(self) -> Trainer:
        """The leader's trainer (with megatron, its collective construction is every rank's)."""
        assert self.setup is not None
        s = self.setup
        return self._trainer_class()(
            s.model_dir,
            self.trainer_cfg,
            core=self.is_core,
            grad_buffer=self.exposed_gradient(),
            packing=s.packing,
            **({"world": self.megatron} if self.megatron is not None else {"device": self._torch_device()}),
        )

    def exposed_gradient(self) -> np.ndarray | None:
        """Where this rank's trainer keeps its gradient: a satellite's, in the buffer the
        transport exposes (the core reads it there); the core's, its own."""
        assert self.setup is not None
        return None if self.is_core else self.setup.transport.gradient_buffer()

    def restore(self) -> None:
        """The core's trainer from the newest intact checkpoint, and that version published."""
        assert self.setup is not None and self.trainer is not None
        s = self.setup
        last, _ = checkpoint.newest_intact(s.checkpoints)  # the controller reports the skipped
        if last is not None:
            info = checkpoint.restore(last, self.trainer)
            log.info("core: resumed from %s (step %s, version %s)", last, info["step"], info["version"])
        if not self.streams:
            s.transport.publish(self.trainer.weights(), self.trainer.version)
        self.publish_slices()

    @property
    def streams(self) -> bool:
        """The engines load from this cell's own slices, whole tensors one at a time (megatron
        cells, no standalone engines): no whole snapshot anywhere."""
        return self.setup is not None and self.setup.transport.plan.params == 0

    def stream_into_engine(self, trainer: Any, hosts: tuple[int, ...], version: int) -> Pushed:
        """This rank's part of streaming the cell's weights into the engines of ``hosts``: its
        engine loads them as ``version`` if it is a host (once back, if it is restarting), and
        it reads the stream to its end whatever happens (the other ranks send to it)."""
        tensors = iter(trainer.hf_tensors(hosts, version) if isinstance(trainer, MirroredTrainer)
                       else trainer.hf_tensors(hosts))  # fmt: skip
        pushed = Pushed()
        try:
            if self.world.cell_comm.Get_rank() in hosts:
                assert self.engine is not None
                while self.engine.restarting:  # it comes back paused, and takes this version then
                    self.engine.supervise()
                    time.sleep(POLL_INTERVAL_S)
                pushed = self.load_engine(tensors, version)
                log.info("cell %d: version %d streamed from the cell's slices into its engine (%d elements)",
                         self.unit, version, pushed.elements)  # fmt: skip
        finally:
            for _ in tensors:
                pass
        return pushed

    def publish_slices(self) -> None:
        """The core: with megatron, each rank's weight slice of the trainer's version as well."""
        transport, trainer = self.setup.transport, self.trainer
        if not transport.plan.slices:
            return
        if isinstance(trainer, MirroredTrainer):
            trainer.publish_slices(transport)
        else:
            publish_slice(trainer, transport)

    def pull_weights(self, version: int) -> None:
        """A satellite's trainer at the core's ``version``: with megatron each rank pulls its
        slice from the core's rank at its place, else the leader pulls the whole snapshot."""
        transport, trainer = self.setup.transport, self.trainer
        if not transport.plan.slices:
            pull_snapshot(trainer, transport, version, self.scratch)
            self.scratch_version = version  # the engine may load it too on a restart
        elif isinstance(trainer, MirroredTrainer):
            trainer.pull_slices(transport, transport.plan.core, version)
        else:
            pull_slice(trainer, transport, transport.plan.core, version)

    def load_pulled(self, version: int) -> Pushed:
        """The core's snapshot ``version`` into this rank's engine part."""
        got = self.setup.transport.pull_snapshot(self.scratch)
        if got != version:
            raise ProtocolError(f"cell {self.unit}: snapshot holds version {got}, expected {version}")
        self.scratch_version = got
        return self.load_engine(self.scratch, version)

    def report_restarts(self) -> None:
        """Each restart of this rank's engine since the last call, an ``engine_restart`` to the
        controller (a member's goes there directly: the controller takes control messages from
        any rank)."""
        while self.engine is not None and self.engine.restarts:
            r = self.engine.restarts.pop(0)
            restart = EngineRestart(cell=self.unit, cause=r.cause, attempts=r.attempts,
                                    seconds=round(r.seconds, 3), version=r.version)  # fmt: skip
            self.to_controller.send(restart, CONTROLLER)

    def newest_weights(self) -> tuple[np.ndarray | None, int]:
        """What a restarted engine loads: the newest weights this cell holds (a copy, taken when
        the engine was found dead), or None where the engines load from the cell's slices (the
        leader streams them again once it is back: ``Leader.catch_up``)."""
        if self.streams:  # a member's part of the replica is its ``mirrored`` trainer
            trainer = self.trainer if self.trainer is not None else getattr(self, "mirrored", None)
            return None, trainer.version if trainer is not None else 0
        if self.trainer is not None and self.is_core:
            return self.trainer.weights().copy(), self.trainer.version
        return self.scratch.copy(), self.scratch_version
