"""Scheduling policy: pure functions of the recipe and the run's state, no I/O.

The same code is used by the MPI runtime and (later) by the discrete-event simulator.
The policy knows nothing about MPI, HTTP or models: it only says which role each cell takes.
"""

from __future__ import annotations

from gyre_hpc.recipe.schema import Mode
from gyre_hpc.runtime.protocol import Role


def initial_roles(mode: Mode, cells: int, async_train_cells: int) -> list[Role]:
    """Roles of cells 0..cells-1 when the run starts.

    elastic and colocate start with every cell sampling (training needs data first); async keeps
    a fixed split for the whole run: the first ``async_train_cells`` cells (core first) train.
    """
    if mode == "async":
        return [Role.TRAINING if c < async_train_cells else Role.SAMPLING for c in range(cells)]
    return [Role.SAMPLING] * cells
