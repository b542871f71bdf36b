"""The shape of the MPI world: which rank does what. A value type with no I/O.

```
 rank 0                    controller
 ranks 1 .. C·R            cells: cell c owns ranks 1 + c·R … c·R + R; the first is its leader
 ranks C·R+1 .. C·R+P      standalone rollout engines (one rank each), numbered as cells C … C+P-1
```

The launchers (``launch.local``, ``launch.sbatch``) size the world with it and the runtime
checks the world it got against it; it knows nothing about MPI, roles or the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.recipe.schema import CellsConfig

CONTROLLER = 0
"""The controller's rank; it also owns the micro-step claim counter."""


@dataclass(frozen=True)
class RankLayout:
    cells: int
    ranks_per_cell: int
    pool: int = 0

    def __post_init__(self) -> None:
        if self.cells < 1 or self.ranks_per_cell < 1 or self.pool < 0:
            raise ValueError(f"invalid layout {self}")

    @classmethod
    def from_config(cls, config: CellsConfig) -> RankLayout:
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
