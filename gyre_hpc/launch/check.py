"""The launch check: what ``recipe check``, ``run`` and ``submit`` ask of a recipe before a world
starts, beyond what loading it validated (``recipe.load``: types, ranges, keys that contradict
each other). One function, ``check_launch``, so the three agree:

```
 recipe ─▶ engines placed on every cell's GPUs (plan.placement) ─▶ backends this runtime drives
        ─▶ trackers installed ─▶ the model's family runs here (models.family)
        ─▶ the memory plan of a cell's worst GPU fits (plan.memory) ─▶ LaunchPlan
```

The first that fails is one ``RecipeError`` line naming the keys that change it. It knows nothing
of processes or files: it reads the recipe and what this Python environment has installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from gyre_hpc.errors import RecipeError
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.catalog import model_shape
from gyre_hpc.models.family import UnsupportedFamily
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
    warnings: tuple[str, ...] = ()
    """What may fail on the cluster though nothing here refuses it (``stack_warnings``)."""


def check_launch(r: Recipe) -> LaunchPlan:
    """The recipe's cells, placed and planned; a ``RecipeError`` (one line) for the first check
    that fails."""
    engines = cell_engines(r.cells, r.slurm, r.engine)
    check_runnable(r.engine, r.trainer)
    check_trackers(r.observability)
    shape = check_model(r.run.model, r.trainer, r.engine)
    memory = check_memory(shape, r.cells, r.engine, r.trainer, r.agent, r.slurm.nodes_per_cell)
    warnings = model_warnings(r.run.model, shape) + installed_stack_warnings(r)
    return LaunchPlan(engines=engines, memory=memory, warnings=warnings)


def check_model(model: str, trainer: TrainerConfig, engine: EngineConfig) -> ModelConfig | None:
    """``run.model``'s shape where it is known here: a family gyre-hpc runs, with attention its
    engines mask right, that the trainer converts."""
    try:
        shape = model_shape(model)
    except UnsupportedFamily as err:
        raise RecipeError(f"run.model = {model!r}: {err}") from None
    if shape is None:
        return None
    if shape.sliding_window is not None:
        raise RecipeError(
            f"run.model = {model!r}: sliding-window attention (config.json sliding_window = "
            f"{shape.sliding_window}) is not supported; valid: a model whose attention sees its whole "
            "context (sliding_window = null, or use_sliding_window = false)"
        )
    if shape.family.experts and engine.weight_sync == "delta":
        raise RecipeError(
            f"run.model = {model!r}: engine.weight_sync = 'delta' cuts the model's own tensors, and a "
            f"{shape.model_type!r} model's engines take its experts one tensor each; valid for it: "
            '"tensor", "broadcast" or "disk"'
        )
    if engine.backend == "sglang" and shape.family.experts and shape.tie_word_embeddings:
        raise RecipeError(
            f"run.model = {model!r}: SGLang's {shape.model_type} does not tie its output head to the "
            "embedding (config.json tie_word_embeddings = true); valid with engine.backend = 'sglang': "
            "an untied model, as published"
        )
    for key, ep in (("engine.ep_size", engine.ep_size), ("trainer.ep_size", trainer.ep_size)):
        if ep > 1 and not shape.num_experts:
            raise RecipeError(
                f"run.model = {model!r}: {key} = {ep} splits routed experts, and a "
                f"{shape.model_type!r} model has none; valid for it: {key} = 1"
            )
        if shape.num_experts % ep:
            raise RecipeError(
                f"run.model = {model!r}: {key} = {ep} must divide its {shape.num_experts} routed experts"
            )
    if trainer.backend == "megatron" and shape.dense_layers:
        raise RecipeError(
            f"run.model = {model!r}: trainer.backend = 'megatron' trains models whose every layer routes "
            f"experts, and layers {shape.dense_layers} of this one are dense (config.json mlp_only_layers, "
            "decoder_sparse_step); valid for it: trainer.backend = 'torch'"
        )
    return shape


def model_warnings(model: str, shape: ModelConfig | None) -> tuple[str, ...]:
    """What the model's family does that the proxy does not yet read."""
    if shape is None or shape.family.tool_format is not None:
        return ()
    return (
        f"warning: run.model is a {shape.model_type!r} model, whose tool-call format the proxy does "
        "not parse yet: its tool calls reach the agent as plain text",
    )


def installed_stack_warnings(r: Recipe) -> tuple[str, ...]:
    """``stack_warnings`` of the SGLang and torch installed here (none without SGLang)."""
    if r.engine.backend != "sglang" or importlib.util.find_spec("sglang") is None:
        return ()
    import torch

    return stack_warnings(r, importlib.metadata.requires("sglang") or [], torch.__version__)


def _major(module: str) -> int | None:
    """The major version of a module such as ``cuda/12.8``."""
    head = module.split("/", 1)[1].split(".")[0]
    return int(head) if head.isdigit() else None


def stack_warnings(r: Recipe, sglang_requires: list[str], torch_version: str) -> tuple[str, ...]:
    """Where SGLang's CUDA stack and the recipe's environment disagree: the torch it pins and
    the one its servers would run with (its kernels are built against the pinned one), and the
    CUDA it needs (``cuda-python>=13``: an R580+ driver) against a CUDA module the job loads.
    Pure: ``sglang_requires`` is its Requires-Dist, ``torch_version`` the running torch's."""
    said = []
    pins = [
        req.split("==", 1)[1].split(";")[0].strip() for req in sglang_requires if req.startswith("torch==")
    ]
    running = torch_version.split("+")[0]
    if pins and pins[0] != running:
        said.append(f"warning: sglang pins torch=={pins[0]}, this environment has torch {torch_version}: "
                    "its servers may fail to load their kernels")  # fmt: skip
    cuda13 = any(req.replace(" ", "").startswith("cuda-python>=13") for req in sglang_requires)
    modules = [word for line in r.slurm.setup for word in line.split() if word.startswith("cuda/")]
    old = [
        m
        for m in modules
        if m.split("/")[1].split(".")[0].isdigit() and int(m.split("/")[1].split(".")[0]) < 13
    ]
    if cuda13 and old:
        said.append(f"warning: sglang needs CUDA 13 (cuda-python>=13.0, an R580+ driver); slurm.setup "
                    f"loads {', '.join(old)}")  # fmt: skip
    return tuple(said)


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
    elif trainer.moe_aux_loss_coeff or trainer.moe_z_loss_coeff:
        raise RecipeError(
            f"trainer.moe_aux_loss_coeff = {trainer.moe_aux_loss_coeff:g}, trainer.moe_z_loss_coeff = "
            f"{trainer.moe_z_loss_coeff:g}: the router's auxiliary losses are megatron's; valid with "
            f"trainer.backend = {trainer.backend!r}: 0 and 0"
        )
    elif trainer.tp_size != 1 or trainer.pp_size != 1 or trainer.ep_size != 1:
        raise RecipeError(
            f"trainer.tp_size = {trainer.tp_size}, trainer.pp_size = {trainer.pp_size}, "
            f"trainer.ep_size = {trainer.ep_size}: the {trainer.backend} trainer computes on one rank; "
            "valid with it: 1, 1 and 1"
        )
