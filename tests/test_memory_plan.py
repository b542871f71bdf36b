"""The memory plan: a pure function of the model's shape, the recipe's sections and the GPU's
size, golden for the flagship recipe at trainer tp 4 and 8 and for the tiny model, and the
refusal a recipe that does not fit gets from `recipe check`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, assert_golden, gyre

from gyre_hpc.errors import RecipeError
from gyre_hpc.models.catalog import KNOWN, TINY_FAMILIES, VOCAB_SIZE, model_shape, tiny_config
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.plan.memory import Shape, check_memory, plan
from gyre_hpc.recipe import load_recipe
from gyre_hpc.sim.config import PAPER_2_4T

FLAGSHIP = REPO / "recipes" / "qwen3-8b-8cells.toml"


def lines(recipe_path, *sets: str) -> str:  # noqa: ANN001
    r = load_recipe(recipe_path, list(sets))
    p = plan(model_shape(r.run.model), r.cells, r.engine, r.trainer, r.agent, r.slurm.nodes_per_cell)
    assert p is not None
    return "\n".join(p.lines()) + "\n"


@pytest.mark.parametrize(
    ("name", "sets"),
    [
        ("qwen3-8b-tp4", ("trainer.tp_size=4",)),  # refused: the longest micro-step does not fit
        ("qwen3-8b-tp8", ()),  # the flagship
        # Two nodes a cell: 16 ranks, tp 8 × pp 2, the engines' pools at 0.8 of a GPU.
        (
            "qwen3-32b-tp8-pp2",
            (
                "run.model=qwen3-32b",
                "cells.ranks_per_cell=16",
                "slurm.nodes_per_cell=2",
                "trainer.tp_size=8",
                "trainer.pp_size=2",
                "engine.mem_fraction_static=0.8",
            ),
        ),
        ("tiny", ("cells.gpu_memory_gib=80", "engine.backend=sglang")),
        # Other families, read from the catalog: Llama 3.1 70B over four nodes a cell (tp 8 × pp 4),
        # Qwen3-30B-A3B (128 experts, 8 a token) over two (tp 8 × pp 2, its experts over the 8
        # ranks of a stage), the engines' pools at 0.8.
        (
            "llama-3.1-70b-tp8-pp4",
            (
                "run.model=llama-3.1-70b",
                "cells.ranks_per_cell=32",
                "slurm.nodes_per_cell=4",
                "trainer.tp_size=8",
                "trainer.pp_size=4",
                "engine.mem_fraction_static=0.8",
            ),
        ),  # fmt: skip
        (
            "qwen3-30b-a3b-tp8-pp2-ep8",
            (
                "run.model=qwen3-30b-a3b",
                "cells.ranks_per_cell=16",
                "slurm.nodes_per_cell=2",
                "trainer.tp_size=8",
                "trainer.pp_size=2",
                "trainer.ep_size=8",
                "engine.mem_fraction_static=0.8",
            ),
        ),  # fmt: skip
        # Qwen3-235B-A22B over eight nodes a cell: tp 8 × pp 4, its experts over the 16 ranks of a
        # stage, engine replicas of two nodes, their pools at 0.7 (the trainer starts beside them).
        (
            "qwen3-235b-a22b-tp8-pp4-ep16",
            (
                "run.model=qwen3-235b-a22b",
                "cells.ranks_per_cell=64",
                "slurm.nodes_per_cell=8",
                "trainer.tp_size=8",
                "trainer.pp_size=4",
                "trainer.ep_size=16",
                "engine.tp_size=16",
                "engine.mem_fraction_static=0.7",
            ),
        ),  # fmt: skip
        # The paper's 2.4T (``catalog.KNOWN["qwen3-moe-2.4t"]``): a cell of 128 nodes, tp 8 × pp 8,
        # its experts over the 128 ranks of a stage (4 of each layer's 512 a rank), two engine
        # replicas of eight nodes each.
        ("qwen3-moe-2.4t-tp8-pp8-ep128", PAPER_2_4T),  # the simulator's paper-2.4t
    ],
)
def test_the_plan_is_golden(name: str, sets: tuple[str, ...]) -> None:
    recipe = REPO / "recipes" / ("smoke.toml" if name == "tiny" else "qwen3-8b-8cells.toml")
    assert_golden(f"memory-plan-{name}.txt", lines(recipe, *sets))


@pytest.mark.parametrize("name", ["tiny", *KNOWN, *(f"tiny-{f}" for f in TINY_FAMILIES)])
def test_the_plan_counts_the_parameters_the_model_has(name: str) -> None:
    """Exactly transformers' count (the flat layout is its model's parameters): the transport
    sizes a torch cell's buffers by it, without building the model."""
    config = (
        tiny_config(VOCAB_SIZE, [], name.removeprefix("tiny-"))
        if name.startswith("tiny-")
        else model_shape(name)
    )
    assert config is not None
    assert Shape.of(config).params == FlatLayout.of(config).numel


def test_the_flagship_fits_only_with_recomputation_and_says_so_in_one_line() -> None:
    r = load_recipe(FLAGSHIP, [])
    fits = check_memory(model_shape(r.run.model), r.cells, r.engine, r.trainer, r.agent)
    assert fits is not None and fits.training.total < fits.gpu_bytes
    assert fits.sampling.total < fits.gpu_bytes and fits.kv_tokens > fits.context_tokens
    assert fits.start_up.total < fits.gpu_bytes
    without = replace(r.trainer, recompute="none")
    with pytest.raises(RecipeError) as err:
        check_memory(model_shape(r.run.model), r.cells, r.engine, without, r.agent)
    assert "training" in str(err.value) and "trainer.recompute" in str(err.value)
    # The CLI says the same in one line, exit 2 (an embedded engine: runnable in this environment).
    proc = gyre("recipe", "check", str(FLAGSHIP), "--set", "engine.backend=embedded",
                "--set", "trainer.recompute=none")  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "memory plan: training" in proc.stderr and "> 140.0 GiB, cells.gpu_memory_gib" in proc.stderr


def test_the_longest_micro_step_is_one_context_and_the_start_is_planned() -> None:
    """A path longer than ``trainer.micro_step_tokens`` is a micro-step of its own: the plan sizes
    the training phase at one context (139,264 tokens), which refuses the flagship with its
    trainer on one GPU (214.2 GiB; at 65,536 tokens 184.6). Its logits are a chunk of rows at a
    time (4.6 GiB of it; whole, 139,264 × 152K logits were 276 GiB here). The start-up phase, the
    trainer built and the core restored beside the engine's pool, refuses a pool of 0.9 of the GPU."""
    r = load_recipe(FLAGSHIP, ["trainer.tp_size=1"])
    shape = model_shape(r.run.model)
    with pytest.raises(RecipeError) as err:
        check_memory(shape, r.cells, r.engine, r.trainer, r.agent)
    said = str(err.value)
    assert said.startswith("memory plan: training 214.2 GiB") and "agent.context_limit_tokens" in said
    assert "logits 4.6," in said
    short = replace(r.agent, context_limit_tokens=r.trainer.micro_step_tokens - r.engine.max_new_tokens)
    shorter = plan(shape, r.cells, r.engine, r.trainer, short)
    assert shorter is not None and shorter.micro_step_tokens == r.trainer.micro_step_tokens
    assert shorter.training.line().startswith("training 184.6 GiB")
    full = replace(load_recipe(FLAGSHIP, []).engine, mem_fraction_static=0.9)
    with pytest.raises(RecipeError, match=r"^memory plan: start-up 141\.4 GiB .* engine.mem_fraction_static"):
        check_memory(shape, r.cells, full, load_recipe(FLAGSHIP, []).trainer, r.agent)


def test_a_kv_cache_smaller_than_one_context_is_refused() -> None:
    r = load_recipe(FLAGSHIP, ["engine.mem_fraction_static=0.05", "engine.tp_size=1"])
    with pytest.raises(RecipeError, match="KV cache holds .* less than one context"):
        check_memory(model_shape(r.run.model), r.cells, r.engine, r.trainer, r.agent)


def test_nothing_is_planned_without_a_gpu_size_or_a_known_shape() -> None:
    smoke = load_recipe(REPO / "recipes" / "smoke.toml", [])
    assert plan(model_shape("tiny"), smoke.cells, smoke.engine, smoke.trainer, smoke.agent) is None
    assert model_shape("/nowhere/my-own-model") is None
    proc = gyre("recipe", "check", "recipes/smoke.toml", "--set", "cells.gpu_memory_gib=80",
                "--set", "run.model=/nowhere/my-own-model", cwd=REPO)  # fmt: skip
    assert proc.returncode == 0 and "memory plan: none" in proc.stdout, proc.stderr


def test_recipe_check_prints_the_plan() -> None:
    proc = gyre("recipe", "check", "recipes/smoke.toml", "--set", "cells.gpu_memory_gib=80", cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "memory plan, the worst GPU of a cell (80.0 GiB)" in proc.stdout
    assert "  sampling " in proc.stdout and "  training " in proc.stdout


def test_delta_pushes_count_the_copies_both_sides_keep_on_the_host() -> None:
    r = load_recipe(FLAGSHIP, [])
    shape = model_shape(r.run.model)
    whole = plan(shape, r.cells, r.engine, r.trainer, r.agent)
    delta = plan(shape, r.cells, replace(r.engine, weight_sync="delta"), r.trainer, r.agent)
    assert whole is not None and delta is not None
    copies = 2 * Shape.of(shape).params * 2  # bf16, both sides
    assert delta.host_leader - whole.host_leader == copies
    assert delta.host_engine_member - whole.host_engine_member == copies
    assert delta.host_member == whole.host_member


def test_a_node_whose_ranks_hold_more_host_memory_than_it_has_is_refused_in_one_line() -> None:
    """Qwen3-32B over two nodes of 8 H200s (tp 8 × pp 2): no rank holds the model whole on the
    host. Every rank holds its slice and that slice's gradient, and a rank hosting an engine
    replica stages a bucket and the largest tensor as its cell streams the weights from its
    slices. 281.5 GiB fits 2 TiB (640.8 when the leader gathered the model whole for its engine
    and published it, and the second replica's host pulled it whole; 823.9 with the leader
    holding the gradient whole too; 2380.4 at tp 8 on one node with every rank holding the
    snapshot and gradient whole); 256 GiB is refused in one line."""
    sets = ["run.model=qwen3-32b", "cells.ranks_per_cell=16", "trainer.tp_size=8", "trainer.pp_size=2",
            "engine.mem_fraction_static=0.8"]  # fmt: skip
    r = load_recipe(FLAGSHIP, sets)
    shape = model_shape("qwen3-32b")
    fits = check_memory(shape, r.cells, r.engine, r.trainer, r.agent, nodes_per_cell=2)
    assert fits is not None and fits.lines()[-1] == (
        "  host 281.5 GiB a node of 8 ranks (leader 37.7, 6 × 34.3, 1 × 37.7 hosting an engine "
        "replica), of 2048.0"
    )
    small = replace(r.cells, host_memory_gib=256)
    with pytest.raises(RecipeError) as err:
        check_memory(shape, small, r.engine, r.trainer, r.agent, nodes_per_cell=2)
    said = str(err.value)
    assert said.startswith("memory plan: host 281.5 GiB a node of 8 ranks (leader 37.7") and "\n" not in said
    assert "> 256.0 GiB, cells.host_memory_gib" in said


@pytest.mark.megatron
def test_context_parallelism_is_planned_and_refused_in_one_line_naming_megatron_s_source() -> None:
    """megatron-core 0.16 asserts cp == 1 outside Transformer Engine's attention (the line quoted);
    the plan still divides a micro-step's activations over cp ranks."""
    import megatron.core.transformer.dot_product_attention as dpa

    line = Path(dpa.__file__).read_text().splitlines()[57:59]
    assert "context_parallel_size == 1" in line[0] and "only supported by TEDotProductAttention" in line[1]
    with pytest.raises(RecipeError, match=r"trainer.cp_size = 2: .*dot_product_attention.py:58.*valid: 1"):
        load_recipe(FLAGSHIP, ["trainer.cp_size=2"])
    r = load_recipe(FLAGSHIP, [])
    shape = model_shape(r.run.model)
    whole = plan(shape, r.cells, r.engine, r.trainer, r.agent)
    split = plan(shape, r.cells, r.engine, replace(r.trainer, cp_size=4), r.agent)
    act = lambda p: next(x.bytes for x in p.training.parts if x.what == "activations")  # noqa: E731
    assert act(split) == pytest.approx(act(whole) / 4, rel=1e-3)
