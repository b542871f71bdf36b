"""What the runtime drives today: a recipe it cannot run is refused before launch, in one line.

``gyre-hpc recipe check``, ``run`` and ``submit`` all ask this one function, so they agree.
"""

from __future__ import annotations

import importlib.util

from gyre_hpc.errors import RecipeError
from gyre_hpc.recipe.schema import EngineConfig, ObservabilityConfig, TrainerConfig


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
