"""The world: the MPI world checked once against the ``RankLayout`` and split into communicators once.

Communicators are built here at start and never rebuilt: a role switch changes what a cell
does, not whom it talks to. The world knows nothing about roles or the recipe beyond its shape.
"""

from __future__ import annotations

from typing import Any

from gyre_hpc.launch.env import JobEnvironment
from gyre_hpc.plan.ranks import RankLayout


class WorldError(RuntimeError):
    """The MPI world does not have the shape the recipe and the launcher promised."""


def check_world_size(size: int, layout: RankLayout, env: JobEnvironment) -> None:
    """Fail loudly, on every rank, when the world is not what it should be (never hang)."""
    if env.launcher != "none" and size != env.ntasks:
        hint = (
            " — srun's --mpi plugin does not match this MPI library (Open MPI needs --mpi=pmix)"
            if env.launcher == "slurm"
            else ""
        )
        raise WorldError(f"MPI world has {_ranks(size)} but {env.launcher} started {env.ntasks} tasks{hint}")
    if size != layout.world_size:
        raise WorldError(
            f"MPI world has {_ranks(size)} but the recipe needs {layout.world_size} "
            f"({layout.describe()}); start it with `gyre-hpc run` or `gyre-hpc submit`"
        )


class World:
    """This rank's place in the world, and the communicators built once for it."""

    def __init__(self, comm: Any, layout: RankLayout, env: JobEnvironment) -> None:
        check_world_size(comm.Get_size(), layout, env)
        self.comm = comm
        self.layout = layout
        self.env = env
        self.rank: int = comm.Get_rank()
        self.unit = layout.unit_of(self.rank)
        # Collective, so built here on every rank at once; the controller gets a comm of its own.
        color = layout.units if self.unit is None else self.unit
        self.cell_comm = comm.Split(color, key=self.rank)

    @property
    def is_controller(self) -> bool:
        return self.unit is None

    @property
    def is_leader(self) -> bool:
        return self.unit is not None and self.rank == self.layout.leader(self.unit)


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"
