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
from pathlib import Path
from types import FrameType

from gyre_hpc.launch.env import JobEnvironment
from gyre_hpc.observability.events import EventLog
from gyre_hpc.rundir import RunDir
from gyre_hpc.runtime.cell import Cell
from gyre_hpc.runtime.controller import Controller
from gyre_hpc.runtime.world import Layout, World

log = logging.getLogger("gyre_hpc.runtime")


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached this rank (scancel, Ctrl-C on the launcher, mpirun)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


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
        filename=run_dir.logs / f"rank-{env.rank}.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    events = EventLog(run_dir.events)
    world = None
    # Slurm's --signal warns of the time limit with SIGUSR2; its default action would kill the rank.
    # Recorded now; checkpointing on it comes with the optimizer state.
    signal.signal(signal.SIGUSR2, lambda signum, frame: log.warning("SIGUSR2: checkpoint requested"))
    try:
        world = World(comm, Layout.from_config(recipe.cells), env)
        kind = "controller" if world.is_controller else "cell"
        run_dir.write_rank(rank, pid=os.getpid(), host=env.node_name, kind=kind, cell=world.unit)
        if world.is_controller:
            Controller(world, recipe.run, recipe.cells, recipe.scheduler, events).run()
        else:
            Cell(world, recipe.cells, recipe.engine).run()
    except Interrupted as sig:
        log.warning("rank %d interrupted by %s", rank, sig)
        if world is not None and world.is_controller:
            events.emit("interrupted", rank=rank, signal=str(sig))
        run_dir.write_exit(rank, 128 + sig.signum)
        return 128 + sig.signum
    except Exception as err:
        log.exception("rank %d failed", rank)
        cell = world.unit if world is not None else None
        error = f"{type(err).__name__}: {err}"
        events.emit("rank_failed", rank=rank, task=env.rank, cell=cell, host=env.node_name, error=error)
        print(f"gyre-hpc: rank {rank} failed: {err}", file=sys.stderr, flush=True)
        run_dir.write_exit(rank, 1)
        comm.Abort(1)
    run_dir.write_exit(rank, 0)
    return 0
