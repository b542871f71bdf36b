"""The launch check: what ``recipe check``, ``run`` and ``submit`` ask of a recipe before a world
starts, beyond what loading it validated (``recipe.load``: types, ranges, keys that contradict
each other). One function, ``check_launch``, so the three agree:

```
 recipe ─▶ engines placed on every cell's GPUs (plan.placement) ─▶ backends this runtime drives
        ─▶ trackers installed ─▶ the memory plan of a cell's worst GPU fits (plan.memory) ─▶ LaunchPlan
```

The first that fails is one ``RecipeError`` line naming the keys that change it. It knows nothing
of processes or files: it reads the recipe and what this Python environment has installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from gyre_hpc.errors import RecipeError
from gyre_hpc.models.catalog import model_shape
from gyre_hpc.plan.memory import MemoryPlan, check_memory
from gyre_hpc.plan.placement import EnginePlan, cell_engines
from gyre_hpc.recipe.schema import EngineConfig, ObservabilityConfig, Recipe, TrainerConfig


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """What a launchable recipe asks of each cell."""

    engines: EnginePlan
    """Its engine replicas over the cell's GPUs and nodes."""
    memory: MemoryPlan | None
    """What its worst GPU holds by role (None where the model's shape is not known here)."""


def check_launch(r: Recipe) -> LaunchPlan:
    """The recipe's cells, placed and planned; a ``RecipeError`` (one line) for the first check
    that fails."""
    engines = cell_engines(r.cells, r.slurm, r.engine)
    check_runnable(r.engine, r.trainer)
    check_trackers(r.observability)
    memory = check_memory(
        model_shape(r.run.model), r.cells, r.engine, r.trainer, r.agent, r.slurm.nodes_per_cell
    )
    return LaunchPlan(engines=engines, memory=memory)


def check_trackers(observability: ObservabilityConfig) -> None:
    """The trackers the recipe asks for are installed (W&B is an optional extra)."""
    if observability.wandb_project and importlib.util.find_spec("wandb") is None:
        raise RecipeError(
            f"observability.wandb_project = {observability.wandb_project!r} needs wandb: "
            "pip install 'gyre-hpc[wandb]', or set observability.wandb_project = \"\""
        )


def check_runnable(engine: EngineConfig, trainer: TrainerConfig) -> None:
    """The backends and shapes this runtime drives today; anything else is refused before launch,
    in one line."""
    if engine.backend == "sglang" and importlib.util.find_spec("sglang") is None:
        raise RecipeError(
            "engine.backend = 'sglang' needs SGLang beside gyre-hpc in this environment (each cell "
            "starts `python -m sglang.launch_server` with this interpreter); here: bash tools/setup.sh "
            "--sglang, then run .venv-sglang/bin/gyre-hpc"
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
