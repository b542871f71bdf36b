"""Entry point of every rank: ``python -m gyre_hpc.runtime RUN_DIR``.

Reads the resolved recipe from the run directory, checks the world, then runs the controller
(rank 0) or its cell. A rank that fails records why (event ``rank_failed``, and its log) and
aborts the whole world, so that no rank is left waiting for it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from gyre_hpc.builtin_models.resolve import resolve_model
from gyre_hpc.diskspace import describe
from gyre_hpc.faults.points import FaultPoints
from gyre_hpc.launch.env import JobEnvironment
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CellHours
from gyre_hpc.observability.events import EventLog
from gyre_hpc.observability.tracking import TensorBoard, Trackers, WandB, Writer
from gyre_hpc.plan.memory import Shape
from gyre_hpc.plan.ranks import CONTROLLER, RankLayout
from gyre_hpc.recipe.schema import Recipe, TrainerConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.runtime import resume
from gyre_hpc.runtime.world import World
from gyre_hpc.sandbox.confine import for_run
from gyre_hpc.transport import Transport, TransportPlan, make_transport

if TYPE_CHECKING:
    from gyre_hpc.runtime.controller import Controller
    from gyre_hpc.runtime.serving import Serving

log = logging.getLogger("gyre_hpc.runtime")


class SignalInterrupt(BaseException):
    """SIGTERM or SIGINT reached this rank (scancel, Ctrl-C on the launcher, mpirun)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise SignalInterrupt(signum)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gyre_hpc.runtime RUN_DIR", file=sys.stderr)
        return 2
    run_dir = RunDir(Path(args[0]))
    env = JobEnvironment.from_environ()
    recipe = run_dir.read_recipe()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_interrupted)

    from mpi4py import MPI  # initialises MPI: only once the recipe is known to be good

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    logging.basicConfig(
        filename=run_dir.rank_log(env.rank),
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    events = EventLog(run_dir.events)
    world = None
    # Slurm's --signal warns of the time limit with SIGUSR2 (its default action would kill the
    # rank): the controller checkpoints the step under way and stops; cells only note it.
    checkpoint_now = threading.Event()

    def on_usr2(signum: int, frame: FrameType | None) -> None:
        log.warning("SIGUSR2: checkpoint requested")
        checkpoint_now.set()

    signal.signal(signal.SIGUSR2, on_usr2)
    try:
        world = World(comm, RankLayout.from_config(recipe.cells), env)
        kind = "controller" if world.is_controller else "cell"
        run_dir.write_rank(rank, pid=os.getpid(), host=env.node_name, kind=kind, cell=world.unit)
        model_dir = resolve_model(recipe.run.model)  # built by the launcher: a cache hit here
        plan = transport_plan(world.layout, model_dir, recipe.trainer)
        transport = make_transport(comm, plan, recipe.transport)
        if world.is_controller:
            controller(world, recipe, run_dir, events, model_dir, transport, checkpoint_now).run()
        else:  # a cell never imports the controller's clients, nor the controller a cell's engines
            from gyre_hpc.runtime.cell import run_cell
            from gyre_hpc.runtime.cell_host import CellSetup

            setup = CellSetup(
                model_dir,
                run_dir.checkpoints,
                transport,
                run_dir.engines,
                recipe.trajectory.packing,
                recipe.slurm.nodes_per_cell,
                FaultPoints.of(env.faults, rank, run_dir.fault_markers),
            )
            run_cell(world, recipe.cells, recipe.engine, recipe.trainer, setup)
        transport.close()  # collective: only on the way out of a run every rank completed
    except SignalInterrupt as sig:
        log.warning("rank %d interrupted by %s", rank, sig)
        if world is not None and world.is_controller:
            best_effort(events.emit, ev.Interrupted(rank=rank, signal=str(sig)))
        best_effort(run_dir.write_exit, rank, 128 + sig.signum)
        return 128 + sig.signum
    except Exception as err:
        # Nothing here may stop the abort: the disk that failed the rank may fail these writes too.
        best_effort(log.exception, "rank %d failed", rank)
        cell = world.unit if world is not None else None
        error = describe(err, run_dir.path)
        best_effort(
            events.emit, ev.RankFailed(rank=rank, task=env.rank, cell=cell, host=env.node_name, error=error)
        )
        best_effort(print, f"gyre-hpc: rank {rank} failed: {error}", file=sys.stderr, flush=True)
        best_effort(run_dir.write_exit, rank, 1)
        comm.Abort(1)
    run_dir.write_exit(rank, 0)
    return 0


def best_effort(fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Call ``fn``; a failure of it (a full disk, a closed stream) is swallowed."""
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - on the way down, what matters is reaching the abort
        pass


def transport_plan(layout: RankLayout, model_dir: Path, trainer: TrainerConfig) -> TransportPlan:
    """Same on every rank: sizes come from the model's config and the trainer's layout, without
    building the model. Every rank of a satellite cell that holds a slice of its replica exposes
    that slice's gradient: a megatron rank its slice in megatron's cut (the same in every cell),
    a torch replica's one rank the whole flat buffer. With megatron each of the core's ranks also
    exposes its weight slice, for its counterparts to pull, and unless standalone engines need
    the weights whole, no whole snapshot is exposed at all: each cell's engines load from its
    own slices (``MegatronTrainer.hf_tensors``)."""
    config = ModelConfig.load(model_dir)
    if trainer.backend != "megatron":
        # The flat layout's size, counted from the config (the memory plan's count, equal to the
        # layout's for every family: test_memory_plan): a rank that builds no model, the
        # controller, does not import transformers (~2 s of CPU) for one number.
        numel = Shape.of(config).params
        grads = {layout.leader(cell): numel for cell in range(1, layout.cells)}
        return TransportPlan(numel, core=layout.leader(0), counter=CONTROLLER, grads=grads)
    from gyre_hpc.models.flat import FlatLayout  # torch: a megatron world's ranks build models anyway
    from gyre_hpc.trainer.megatron_weights import MegatronLayout, slice_numel

    flat = FlatLayout.of(config)
    cut = MegatronLayout(config, tp=trainer.tp_size, pp=trainer.pp_size, ep=trainer.ep_size)
    shapes = {name: shape for name, (_, shape) in flat.slots.items()}
    size = layout.ranks_per_cell
    places = [cut.place(i, size) for i in range(size)]
    values = [slice_numel(cut, shapes, tp_rank, stage) for stage, tp_rank, _ in places]
    grads = {
        rank: values[i] for cell in range(1, layout.cells) for i, rank in enumerate(layout.ranks_of(cell))
    }
    slices = {rank: 4 * values[i] for i, rank in enumerate(layout.ranks_of(0))}
    params = 0 if layout.pool == 0 else flat.numel
    return TransportPlan(params, core=layout.leader(0), counter=CONTROLLER, grads=grads, slices=slices)


def controller(
    world: World,
    recipe: Recipe,
    run_dir: RunDir,
    events: EventLog,
    model_dir: Path,
    transport: Transport,
    checkpoint_now: threading.Event,
) -> Controller:
    """Rank 0: resumes from the newest intact checkpoint, and the executions journalled after it."""
    from gyre_hpc.runtime.controller import Controller, Watch
    from gyre_hpc.runtime.fleet import MpiFleet, Waits
    from gyre_hpc.runtime.serving import Serving

    attempt = 1 + sum(isinstance(e, ev.WorldUp) for e in run_dir.read_events())
    events.emit(
        ev.WorldUp(
            size=world.layout.world_size,
            layout=world.layout.describe(),
            launcher=world.env.launcher,
            job_id=world.env.job_id,
            transport=transport.name,
            attempt=attempt,
        )
    )
    point = resume.prepare(run_dir)  # before the proxy opens the TITO log
    for problem in point.skipped:
        print(f"gyre-hpc: checkpoint skipped: {problem}", file=sys.stderr, flush=True)
    if point.lost_record is not None:  # the last world died between marking the step and recording it
        events.emit(point.lost_record)
    if attempt > 1 or point.step:
        events.emit(
            ev.Resumed(
                step=point.step + 1,
                version=point.version,
                checkpoint=point.checkpoint,
                skipped=point.skipped,
                continued=point.continued,
                kept_finished=point.kept_finished,
                dropped_records=point.dropped_records,
            )
        )

    def make_serving(engines: dict[str, int], on_event: Callable[[str, str], None]) -> Serving:
        warnings: list[str] = []
        sandbox = for_run(
            recipe.agent,
            run_dir.path,
            recipe.tasks.suite,
            warnings.append,
            scoring_binds=recipe.scoring.sandbox_binds,
        )
        for line in warnings:
            print(f"gyre-hpc: {line}", file=sys.stderr, flush=True)
        events.emit(
            ev.SandboxUp(backend=sandbox.kind, warning=" ".join(warnings), limits=sandbox.groups.kind)
        )
        serving = Serving(
            run_dir,
            model_dir,
            engines,
            proxy=recipe.proxy,
            agent=recipe.agent,
            engine=recipe.engine,
            scoring=recipe.scoring,
            capacity=recipe.proxy.admission_limit or recipe.cells.capacity,
            seed=recipe.run.seed,
            on_event=on_event,
            sandbox=sandbox,
            executors=recipe.executors,
            emit=events.emit,
            faults=world.env.faults,
            routes=recipe.trainer.routing_replay,
        )
        fleet.liveness.append(serving.check)  # a dead proxy worker fails the controller's wait
        return serving

    waits = Waits.of(recipe.cells, recipe.engine)
    hours, since = CellHours(time.monotonic()), time.time()  # the cells' first window starts here
    fleet = MpiFleet(
        world.comm, world.layout, recipe.cells, transport, events, waits, point.version, hours=hours
    )
    r = recipe
    watch = Watch(
        trackers=trackers(r, run_dir), hours=hours, loads=fleet.loads, clock=fleet.clock, since=since
    )
    return Controller(
        fleet=fleet,
        make_serving=make_serving,
        events=events,
        run_dir=run_dir,
        run=r.run,
        scheduler=r.scheduler,
        tasks=r.tasks,
        trajectory=r.trajectory,
        trainer=r.trainer,
        first_step=point.step + 1,
        checkpoint_now=checkpoint_now,
        watch=watch,
        faults=FaultPoints.of(world.env.faults, world.rank, run_dir.fault_markers),
    )


def trackers(recipe: Recipe, run_dir: RunDir) -> Trackers:
    """The recipe's experiment trackers (``observability``), writing into the run directory."""
    o = recipe.observability
    writers: list[Writer] = []
    if o.tensorboard:
        writers.append(TensorBoard(run_dir.tensorboard))
    if o.wandb_project:
        config = {"recipe": str(run_dir.recipe_path), "name": recipe.run.name, "seed": recipe.run.seed}
        writers.append(WandB(o.wandb_project, o.wandb_mode, run_dir.wandb, run_dir.path.name, config))
    return Trackers(writers)
