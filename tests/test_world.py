"""The world's layout and its self-check."""

from __future__ import annotations

import importlib.util

import pytest

from gyre_hpc.errors import RecipeError
from gyre_hpc.launch.check import check_runnable
from gyre_hpc.launch.env import JobEnvironment
from gyre_hpc.plan.ranks import RankLayout
from gyre_hpc.recipe.schema import EngineConfig, TrainerConfig
from gyre_hpc.runtime.world import WorldError, check_world_size


def test_layout_assigns_ranks_to_cells_then_pool() -> None:
    layout = RankLayout(cells=2, ranks_per_cell=3, pool=2)
    assert layout.world_size == 9
    assert [layout.unit_of(r) for r in range(9)] == [None, 0, 0, 0, 1, 1, 1, 2, 3]
    assert [layout.leader(u) for u in range(layout.units)] == [1, 4, 7, 8]
    assert layout.ranks_of(1) == [4, 5, 6]
    assert [layout.is_standalone(u) for u in range(4)] == [False, False, True, True]
    assert layout.describe() == "1 controller + 2 cells × 3 ranks + 2 rollout engines"


def test_every_rank_has_exactly_one_place() -> None:
    layout = RankLayout(cells=3, ranks_per_cell=2, pool=1)
    owned = sorted(r for u in range(layout.units) for r in layout.ranks_of(u))
    assert owned == list(range(1, layout.world_size))
    with pytest.raises(ValueError):
        layout.unit_of(layout.world_size)


def test_size_one_world_under_srun_names_the_mpi_plugin() -> None:
    env = JobEnvironment.from_environ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "3"})
    with pytest.raises(WorldError, match=r"MPI world has 1 rank but slurm started 3 tasks .*--mpi=pmix"):
        check_world_size(1, RankLayout(2, 1), env)


def test_world_must_match_the_recipe() -> None:
    env = JobEnvironment.from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"})
    with pytest.raises(WorldError, match=r"recipe needs 3 \(1 controller \+ 2 cells × 1 ranks\)"):
        check_world_size(4, RankLayout(2, 1), env)
    check_world_size(
        3,
        RankLayout(2, 1),
        JobEnvironment.from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}),
    )


def refusal(engine: str = "embedded", **trainer: object) -> str:
    with pytest.raises(RecipeError) as err:
        check_runnable(EngineConfig(backend=engine), TrainerConfig(**trainer))
    return str(err.value)


def test_what_the_runtime_does_not_drive_is_refused_in_one_line() -> None:
    if importlib.util.find_spec("sglang") is None:  # this environment (.venv); .venv-sglang has it
        assert refusal(engine="sglang").startswith("engine.backend = 'sglang' needs SGLang beside gyre-hpc")
    assert refusal(tp_size=2) == (
        "trainer.tp_size = 2, trainer.pp_size = 1, trainer.ep_size = 1: the torch trainer computes on "
        "one rank; valid with it: 1, 1 and 1"
    )
