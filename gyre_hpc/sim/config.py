"""What the simulator models: the cluster, the workload and the costs, one small dataclass.

Named configurations document their assumptions next to each number.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gyre_hpc.recipe.schema import Mode


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    cells: int = 4
    """Cells in switch order (cell 0 is the core)."""
    capacity: int = 8
    """Concurrent executions one sampling cell serves."""
    pool_capacity: int = 0
    """Concurrent executions of the standalone rollout pool (never trains)."""
    prompts: int = 8
    group_size: int = 4
    steps: int = 6
    duration_median_s: float = 60.0
    """Median execution wall time while served."""
    duration_sigma: float = 0.8
    """Log-normal spread of execution durations: the long tail."""
    timeout_s: float = 600.0
    """Executions are cut here and partially scored."""
    exec_overhead_s: float = 0.0
    """Fixed time added to every execution (harness, proxy and tool time besides decoding)."""
    train_s_per_exec: float = 4.0
    """One cell's training time for one execution's tokens."""
    micro_step_s: float = 1.0
    """Training time of one micro-step on one cell."""
    micro_step_tokens: int = 8192
    """Replayed workloads: tokens packed into one micro-step (as ``trainer.micro_step_tokens``)."""
    train_s_per_token: float = 0.0
    """Replayed workloads: one cell's training time per token."""
    switch_to_train_s: float = 1.0
    switch_to_sample_s: float = 0.5
    publish_s: float = 0.5
    """Optimizer step and publication of the new version by the core."""
    load_s: float = 0.0
    """Each weight load into engines (0: folded into ``publish_s``)."""
    async_train_cells: int = 1
    """async: cells that always train. ``bench sim`` sweeps every split and compares the best."""
    min_queued: int = 1
    carry_tail: bool = False
    """Ours: apply each elastic step when its burst ends, the rest leads the next step's queue."""
    max_staleness: int = 0
    """In-flight weight updates (elastic): steps close at their quota of groups; executions cross
    versions, stopped when they would be trained more than this many versions behind (0: off)."""
    lookahead: float = 0.25
    """In-flight: the share of the next step's prompts each step dispatches with its own."""
    checkpoint_every: int = 0
    """Steps that write a checkpoint train their whole tail (as ``trainer.checkpoint_every``)."""
    shape: tuple[str, ...] = ()
    """The model and layout it stands for, as recipe settings (over ``recipes/qwen3-8b-8cells.toml``):
    the memory plan of that recipe holds a cell's ``capacity`` contexts (``tests/test_sim.py``)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "cells",
            "capacity",
            "prompts",
            "group_size",
            "steps",
            "async_train_cells",
            "min_queued",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}; valid: 1 or more")
        if not 0.0 <= self.lookahead <= 1.0:
            raise ValueError(f"lookahead = {self.lookahead}; valid: 0 to 1")

    def with_(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)


PAPER_2_4T = (
    "run.model=qwen3-moe-2.4t",
    "cells.ranks_per_cell=1024",
    "slurm.nodes_per_cell=128",
    "trainer.tp_size=8",
    "trainer.pp_size=8",
    "trainer.ep_size=128",
    "engine.tp_size=64",
    "engine.mem_fraction_static=0.7",
)
"""The paper's 2.4T model (``catalog.KNOWN["qwen3-moe-2.4t"]``) on H200 nodes: a cell of 128 nodes,
tp 8 × pp 8, its experts over the 128 ranks of a stage (4 of each layer's 512 a rank), engine
replicas of eight nodes each; the memory plan's golden layout and the simulator's."""

CONFIGS: dict[str, SimConfig] = {
    # The smoke recipe's shape on this machine: 2 cells of 8, 8 prompts × 4, ~2 s executions.
    "smoke": SimConfig(
        cells=2,
        capacity=8,
        prompts=8,
        group_size=4,
        steps=20,
        duration_median_s=2.0,
        duration_sigma=0.6,
        timeout_s=120.0,
        train_s_per_exec=0.1,
        micro_step_s=0.1,
        switch_to_train_s=0.05,
        switch_to_sample_s=0.02,
        publish_s=0.05,
    ),
    # The paper's 2.4T regime. The paper gives the ratios, the 48-step totals and the switch
    # times; everything else is assumed here: 8 cells of 16 concurrent executions, one batch
    # fills the cluster (32 prompts × 4), a 1.5 h timeout with durations log-normal around 0.5×
    # the timeout (σ 0.5, ~8 % cut), one execution's tokens cost 160 cell-seconds to train in
    # 20 s micro-steps, 30 s to publish a version. The paper gives no async split: every split
    # is simulated and the best one is the baseline. A cell is ``PAPER_2_4T``'s: 1024 GPUs whose
    # 16 engine replicas hold 64 full contexts; 16 executions a cell leave room for the long tail.
    "paper-2.4t": SimConfig(
        shape=PAPER_2_4T,
        cells=8,
        capacity=16,
        prompts=32,
        group_size=4,
        steps=48,
        duration_median_s=2700.0,
        duration_sigma=0.5,
        timeout_s=5400.0,
        train_s_per_exec=160.0,
        micro_step_s=20.0,
        switch_to_train_s=8.52,
        switch_to_sample_s=3.46,
        publish_s=30.0,
    ),
    # The paper's 122B regime (all assumed but the ratio range): 16 cells of 8, a 1 h timeout,
    # durations around 0.3× the timeout (σ 0.6), 300 cell-seconds of training per execution in
    # 15 s micro-steps, faster switches and publication than at 2.4T; every async split.
    "paper-122b": SimConfig(
        cells=16,
        capacity=8,
        prompts=32,
        group_size=4,
        steps=48,
        duration_median_s=1080.0,
        duration_sigma=0.6,
        timeout_s=3600.0,
        train_s_per_exec=300.0,
        micro_step_s=15.0,
        switch_to_train_s=5.0,
        switch_to_sample_s=2.0,
        publish_s=15.0,
    ),
}

OURS = "elastic+carry"
"""The paper's elastic rule plus ours, ``carry_tail`` (``scheduler.carry_tail`` in a recipe)."""


def inflight_name(k: int) -> str:
    """Ours with in-flight weight updates (``scheduler.max_staleness = k``)."""
    return f"in-flight k={k}"


INFLIGHT_KS = (1, 2)


def async_name(split: int, cells: int) -> str:
    return f"async {split}/{cells}"


def async_splits(cfg: SimConfig) -> dict[str, SimConfig]:
    """Every fixed split async can take: 1 … all cells training (a pool keeps sampling), or
    1 … all but one."""
    top = cfg.cells if cfg.pool_capacity else cfg.cells - 1
    return {async_name(k, cfg.cells): cfg.with_(async_train_cells=k) for k in range(1, top + 1)}


def variants(cfg: SimConfig) -> dict[str, tuple[Mode, SimConfig]]:
    """What ``bench sim`` compares: elastic, colocate, every async split, and elastic with our
    improvements (``carry_tail``; in-flight updates at k = 1 and 2)."""
    return {
        "elastic": ("elastic", cfg),
        "colocate": ("colocate", cfg),
        **{name: ("async", c) for name, c in async_splits(cfg).items()},
        OURS: ("elastic", cfg.with_(carry_tail=True)),
        **{inflight_name(k): ("elastic", cfg.with_(max_staleness=k)) for k in INFLIGHT_KS},
    }


def ablations(cfg: SimConfig) -> dict[str, tuple[tuple[Mode, SimConfig], tuple[Mode, SimConfig]]]:
    """The paper's ablations the runtime's step kinds can run, as (baseline, variant) pairs: the
    ratio baseline / variant. Its two streaming ablations (async and colocate turning groups into
    micro-steps as they complete) have no step kind: only elastic and in-flight stream."""
    bigger = cfg.with_(
        cells=cfg.cells // 2,
        capacity=cfg.capacity * 2,
        train_s_per_exec=cfg.train_s_per_exec / 2,
        micro_step_s=cfg.micro_step_s / 2,
    )
    return {"half as many cells, twice as large": (("elastic", cfg), ("elastic", bigger))}


PAPER_ABLATIONS = {"half as many cells, twice as large": "costs 2.2 %"}
