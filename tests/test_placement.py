"""Where a cell's engine replicas run (``placement``), and the commands each part starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_golden

from gyre_hpc.engines.sglang import Span, sglang_command
from gyre_hpc.errors import RecipeError
from gyre_hpc.launch.check import check_launch, stack_warnings
from gyre_hpc.plan.placement import EnginePart, cell_engines, check_engine_plan, engine_plan
from gyre_hpc.recipe.load import load_recipe
from gyre_hpc.recipe.schema import EngineConfig
from gyre_hpc.rundir import engine_part_dir


def test_every_gpu_of_a_node_serves_one_replica_per_tensor_parallel_group() -> None:
    plan = engine_plan(8, 1, 4)  # the flagship cell
    assert plan.replicas == 2 and plan.idle_gpus == 0
    assert [(p.host_rank, p.base_gpu, p.gpus) for p in plan.parts] == [(0, 0, 4), (4, 4, 4)]
    one_each = engine_plan(2, 1, 1)
    assert one_each.replicas == 2 and [p.host_rank for p in one_each.parts] == [0, 1]
    two_nodes = engine_plan(16, 2, 4)
    assert [(p.node, p.host_rank, p.base_gpu) for p in two_nodes.parts] == [
        (0, 0, 0), (0, 4, 4), (1, 8, 0), (1, 12, 4),
    ]  # fmt: skip


def test_a_replica_larger_than_a_node_spans_whole_nodes_with_one_head() -> None:
    plan = engine_plan(32, 4, 16)  # two replicas of 16 GPUs on nodes of 8
    assert plan.replicas == 2
    assert plan.parts == (
        EnginePart(0, 0, 0, 0, 8, 2, 0),
        EnginePart(0, 8, 1, 0, 8, 2, 1),
        EnginePart(1, 16, 2, 0, 8, 2, 0),
        EnginePart(1, 24, 3, 0, 8, 2, 1),
    )
    assert [p.head for p in plan.parts] == [True, False, True, False]
    with pytest.raises(RecipeError, match="engine.tp_size = 12 spans nodes of 8 GPUs"):
        engine_plan(16, 2, 12)
    with pytest.raises(RecipeError, match="divides the cell's 3 nodes"):
        engine_plan(24, 3, 16)


def test_gpus_left_without_an_engine_are_refused_in_one_line_unless_allowed() -> None:
    plan = engine_plan(6, 1, 4)
    assert plan.replicas == 1 and plan.idle_gpus == 2
    check_engine_plan(plan, allow_idle_gpus=True)
    with pytest.raises(RecipeError, match="2 GPUs of each cell would have no engine") as err:
        check_engine_plan(plan, allow_idle_gpus=False)
    assert "\n" not in str(err.value) and "engine.allow_idle_gpus = true" in str(err.value)
    # A recipe loads whatever its engines; the launch check (run, submit, recipe check) refuses.
    idle = load_recipe(None, ["cells.ranks_per_cell=6", "engine.tp_size=4"])
    with pytest.raises(RecipeError, match="2 GPUs of each cell would have no engine"):
        check_launch(idle)
    allowed = load_recipe(None, ["cells.ranks_per_cell=6", "engine.tp_size=4", "engine.allow_idle_gpus=true"])
    assert check_launch(allowed).engines.idle_gpus == 2


def test_a_replica_across_nodes_takes_its_weights_by_reference_from_each_node_but_not_as_deltas() -> None:
    """Every part's rank stages the weights on its node (``engines.sglang.PartPush``): by
    reference, broadcast (the CPU) or from disk; a delta would need each node to keep and check
    its own, which is not offered."""
    sets = ["cells.ranks_per_cell=16", "slurm.nodes_per_cell=2", "engine.tp_size=16", "engine.backend=sglang"]
    r = load_recipe(None, sets)  # tensor, the default
    plan = cell_engines(r.cells, r.slurm, r.engine)
    assert (
        plan.replicas == 1 and plan.weight_hosts() == (0,) and plan.weight_hosts(by_reference=True) == (0, 8)
    )
    assert [p.host_rank for p in plan.parts_of(0)] == [0, 8]
    with pytest.raises(RecipeError, match='"delta" is not offered across nodes; set engine.weight_sync = '
                                          '"tensor", "broadcast" or "disk"$'):  # fmt: skip
        check_launch(load_recipe(None, [*sets, "engine.weight_sync=delta"]))
    r = load_recipe(None, [*sets, "engine.weight_sync=broadcast"])
    assert cell_engines(r.cells, r.slurm, r.engine).replicas == 1
    gpus = [*sets, "slurm.gpus_per_node=8"]
    with pytest.raises(RecipeError, match='spans nodes: .* set engine.weight_sync = "tensor" or "disk"$'):
        check_launch(load_recipe(None, [*gpus, "engine.weight_sync=delta"]))
    for sync in ("tensor", "disk"):
        r = load_recipe(None, [*gpus, f"engine.weight_sync={sync}"])
        assert cell_engines(r.cells, r.slurm, r.engine).replicas == 1


@pytest.mark.parametrize("where", ["slurm.gpus_per_node=8", "slurm.gpu_per_task=true"])
def test_on_gpus_no_replica_takes_its_weights_by_broadcast(where: str) -> None:
    """The broadcast's group would hold the cell leader's GPU twice, which NCCL refuses."""
    sets = ["engine.backend=sglang", "engine.tp_size=1", "engine.weight_sync=broadcast", where]
    if where == "slurm.gpu_per_task=true":
        sets.append("slurm.gpus_per_node=0")
    with pytest.raises(RecipeError, match="would hold the cell leader's GPU twice"):
        check_launch(load_recipe(None, sets))
    r = load_recipe(None, [*sets[:2], *sets[3:]])  # tensor, by reference on the leader's GPU
    assert cell_engines(r.cells, r.slurm, r.engine).replicas == r.cells.ranks_per_cell


def test_the_launch_plan_of_a_cell_across_two_nodes() -> None:
    """Each part's command on its node: the head serves HTTP and takes the weights; the other
    part joins it at the head's address with its node rank. Qwen3-235B-A22B as its MoE recipes
    serve it: experts over the replica's 16 GPUs, attention in 4 data-parallel groups (its 4
    key/value heads whole in each)."""
    engine = EngineConfig(backend="sglang", tp_size=16, ep_size=16, attn_dp_size=4, weight_sync="broadcast")
    plan = engine_plan(16, 2, 16)
    lines = [plan.describe(), ""]
    for p in plan.parts:
        span = Span(p.nnodes, p.node_rank, "node-a:29500")
        port = 30000 + p.node
        cmd = sglang_command(engine, "/shared/models/Qwen3-235B", port, "0.0.0.0", "python", "cuda", 0, span)
        lines.append(f"node {p.node} (cell rank {p.host_rank}): {' '.join(cmd)}")
    lines += ["", engine_plan(8, 1, 4).describe(), engine_plan(6, 1, 4).describe()]
    assert_golden("engine-plan.txt", "\n".join(lines) + "\n")


def test_each_part_of_a_cell_logs_to_its_own_directory() -> None:
    """Emulated nodes share one file system: a replica's second part must not write over its
    head's log."""
    plan = engine_plan(ranks_per_cell=4, nodes_per_cell=2, tp_size=4)
    assert [engine_part_dir(Path("e"), 3, p.replica, p.node_rank).name for p in plan.parts] == [
        "unit-3",
        "unit-3-part-1",
    ]
    two = engine_plan(ranks_per_cell=2, nodes_per_cell=1, tp_size=1)
    assert [engine_part_dir(Path("e"), 0, p.replica, p.node_rank).name for p in two.parts] == [
        "unit-0",
        "unit-0-replica-1",
    ]


def test_sglang_s_cuda_stack_against_the_recipe_s_is_said_as_warnings() -> None:
    """SGLang pins the torch its kernels were built against and needs CUDA 13: ``recipe check``
    says where the environment or the job's modules disagree (it cannot refuse: the cluster's
    environment is not this one)."""
    requires = ["cuda-python>=13.0", "torch==2.14.1", "torchvision"]
    r = load_recipe(None, ["engine.backend=sglang", "slurm.setup=['module load openmpi/4.1 cuda/12.8']"])
    assert stack_warnings(r, requires, "2.13.0+cpu") == (
        "warning: sglang pins torch==2.14.1, this environment has torch 2.13.0+cpu: its servers may fail "
        "to load their kernels",
        "warning: sglang needs CUDA 13 (cuda-python>=13.0, an R580+ driver); slurm.setup loads cuda/12.8",
    )
    fine = load_recipe(None, ["engine.backend=sglang", "slurm.setup=['module load cuda/13.0']"])
    assert stack_warnings(fine, requires, "2.14.1+cu130") == ()
