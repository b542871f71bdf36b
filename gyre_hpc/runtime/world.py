"""The world: which rank does what, checked once and split into communicators once.

```
 rank 0                    controller
 ranks 1 .. C·R            cells: cell c owns ranks 1 + c·R … c·R + R; the first is its leader
 ranks C·R+1 .. C·R+P      standalone rollout engines (one rank each), numbered as cells C … C+P-1
```

Communicators are built here at start and never rebuilt: a role switch changes what a cell
does, not whom it talks to. The world knows nothing about roles or the recipe beyond its shape.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from gyre_hpc.errors import RecipeError
from gyre_hpc.launch.env import JobEnvironment
from gyre_hpc.recipe.schema import CellsConfig, EngineConfig, TrainerConfig

CONTROLLER = 0


class WorldError(RuntimeError):
    """The MPI world does not have the shape the recipe and the launcher promised."""


@dataclass(frozen=True)
class Layout:
    cells: int
    ranks_per_cell: int
    pool: int = 0

    def __post_init__(self) -> None:
        if self.cells < 1 or self.ranks_per_cell < 1 or self.pool < 0:
            raise ValueError(f"invalid layout {self}")

    @classmethod
    def from_config(cls, config: CellsConfig) -> Layout:
        return cls(config.count, config.ranks_per_cell, config.rollout_pool)

    @property
    def world_size(self) -> int:
        return 1 + self.cells * self.ranks_per_cell + self.pool

    @property
    def units(self) -> int:
        """Cells plus standalone engines: everything that says hello."""
        return self.cells + self.pool

    def unit_of(self, rank: int) -> int | None:
        """The cell (or standalone engine, numbered after the cells) of ``rank``; None for rank 0."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        if rank == CONTROLLER:
            return None
        cell_ranks = self.cells * self.ranks_per_cell
        if rank <= cell_ranks:
            return (rank - 1) // self.ranks_per_cell
        return self.cells + rank - cell_ranks - 1

    def ranks_of(self, unit: int) -> list[int]:
        if unit < self.cells:
            first = 1 + unit * self.ranks_per_cell
            return list(range(first, first + self.ranks_per_cell))
        return [1 + self.cells * self.ranks_per_cell + unit - self.cells]

    def leader(self, unit: int) -> int:
        return self.ranks_of(unit)[0]

    def is_standalone(self, unit: int) -> bool:
        return unit >= self.cells

    def describe(self) -> str:
        pool = f" + {self.pool} rollout engines" if self.pool else ""
        return f"1 controller + {self.cells} cells × {self.ranks_per_cell} ranks{pool}"


def check_runnable(engine: EngineConfig, trainer: TrainerConfig, cells: CellsConfig) -> None:
    """The backends and shapes this runtime drives today; anything else is refused before launch,
    in one line."""
    if engine.backend not in ("embedded", "emulated"):
        raise RecipeError(
            f"engine.backend = {engine.backend!r} is not driven by the runtime yet (the SGLang client and "
            "launcher exist, the cell does not start it); valid for gyre-hpc run/submit today: "
            "embedded, emulated"
        )
    if trainer.backend == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise RecipeError(
                "trainer.backend = 'megatron' needs megatron-core: pip install -e '.[megatron]'"
            )
    elif trainer.tp_size != 1 or trainer.pp_size != 1:
        raise RecipeError(
            f"trainer.tp_size = {trainer.tp_size}, trainer.pp_size = {trainer.pp_size}: the "
            f"{trainer.backend} trainer computes on one rank; valid with it: 1 and 1"
        )


def check_world_size(size: int, layout: Layout, env: JobEnvironment) -> None:
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

    def __init__(self, comm: Any, layout: Layout, env: JobEnvironment) -> None:
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
