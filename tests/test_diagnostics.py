"""The step's diagnostics: token stats (clip, KL, entropy, the trainer/rollout log-prob
mismatch) measured by the real trainer on what a real engine sampled, the rollout's shape, and
where each cell's time went."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.execution.outcome import Execution, Outcome, ScoreResult
from gyre_hpc.loss.diagnostics import token_stats
from gyre_hpc.loss.token_stats import MISMATCH_AT, TokenStats
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.observability.cell_time import CATEGORIES, RoleClock, cell_time
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.step.stats import rollout_shape, spread
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.sequences import TrainSequence

PROMPTS = [[1, 2, 3, 4], list(range(40, 70)), [7] * 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def sampled(generate, temperature: float, version: int = 0) -> list[TrainSequence]:  # noqa: ANN001
    """One sequence per prompt: the engine's reply at ``temperature`` with its own log-probs as
    the behaviour, as the proxy records them."""
    out = []
    for prompt in PROMPTS:
        ids, logprobs = generate(
            prompt, {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True}
        )
        n = len(prompt)
        out.append(
            TrainSequence(
                run_id=f"r{len(out)}",
                tokens=np.array(prompt + ids),
                loss_mask=np.array([0] * n + [1] * len(ids), dtype=np.float32),
                behaviour_logprobs=np.array([0.0] * n + logprobs, dtype=np.float32),
                advantage=1.0,
                token_weight=1.0 / len(ids),
                versions=np.full(n + len(ids), version),
            )
        )
    return out


def embedded(engine: Engine):  # noqa: ANN201
    def generate(prompt: list[int], params: dict) -> tuple[list[int], list[float]]:
        done: dict = {}
        engine.submit(prompt, SamplingParams.from_request(params), done.update)
        while not done:
            time.sleep(0.005)
        return done["output_ids"], [lp for lp, _, _ in done["meta_info"]["output_token_logprobs"]]

    return generate


def trained(tiny: Path, sequences: list[TrainSequence], packing: str = "paths") -> dict:
    trainer = TorchTrainer(tiny, TrainerConfig(), core=True, packing=packing)
    return trainer.micro_step(sequences).token_stats.summary()


def test_the_mismatch_is_rounding_on_the_embedded_engine_and_shows_a_wrong_temperature(tiny: Path) -> None:
    engine = Engine(tiny, max_running=4).start()
    try:
        right = sampled(embedded(engine), 1.0)
        wrong = sampled(embedded(engine), 0.7)  # the engine samples sharper than the trainer scores
        stale = sampled(embedded(engine), 0.7, version=3)  # …but from another version: not counted
    finally:
        engine.stop()
    for packing in ("paths", "tree"):
        ok, bad = trained(tiny, right, packing), trained(tiny, wrong, packing)
        assert ok["mismatch_tokens"] == bad["mismatch_tokens"] == 72
        assert ok["mismatch_mean"] < 1e-4 and ok["mismatch_max"] < 1e-3 and ok["mismatch_share"] == 0
        assert (
            bad["mismatch_mean"] > 0.05 and bad["mismatch_share"] > 0.1 and bad["mismatch_max"] > MISMATCH_AT
        )
        assert bad["approx_kl"] > 10 * ok["approx_kl"]
        assert 0 < ok["entropy"] < np.log(1000)  # nats, below a uniform draw over the vocabulary
        other = trained(tiny, stale, packing)
        assert other["mismatch_tokens"] == 0 and other["mismatch_mean"] is None
        assert other["approx_kl"] == pytest.approx(bad["approx_kl"], rel=0.5)  # KL counts every token


def test_token_stats_add_up_across_micro_steps_and_cells() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    b = torch.tensor([-1.0, -1.5, -0.5, -3.5])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    matched = torch.tensor([True, True, False, True])
    a = token_stats(lp, b, mask, 0.2, 0.2, matched, torch.ones(4))
    assert (a.tokens, a.matched, a.mismatch_over, a.entropy_tokens) == (3, 2, 2, 3)
    assert a.mismatch_max == pytest.approx(0.5) and a.clipped == 2  # ratios e^-0.5 and e^0.5
    both = a + TokenStats(tokens=1, matched=1, mismatch_sum=0.9, mismatch_max=0.9, mismatch_over=1)
    assert (both.tokens, both.matched, both.mismatch_max) == (4, 3, 0.9)
    assert TokenStats.from_list(both.as_list()) == both
    assert TokenStats().summary()["mismatch_mean"] is None


def outcome(run: str, task: str, reward: float, calls: int) -> Outcome:
    return Outcome(
        execution=Execution(run_id=run, task_id=task, workspace=Path("/w"), status="finished", calls=calls),
        score=ScoreResult(run_id=run, kind="scored", reward=reward, attempts=1),
    )


def test_the_rollout_shape_counts_groups_without_signal_and_spreads_calls() -> None:
    outcomes = [
        outcome("a0", "a", 1.0, 2), outcome("a1", "a", 1.0, 4),  # equal rewards: no advantage
        outcome("b0", "b", 0.0, 6), outcome("b1", "b", 1.0, 8),
    ]  # fmt: skip
    shape = rollout_shape(outcomes, [])
    assert (shape["no_signal_groups"], shape["group_count"]) == (1, 2)
    assert shape["calls_per_execution"] == {"mean": 5.0, "p50": 5.0, "p90": 7.4, "max": 8.0}
    assert spread([]) == {}


def test_a_cell_s_categories_fill_its_window() -> None:
    clock = RoleClock(now=100.0)
    clock.mark(0, "sampling", 100.0)
    clock.mark(1, "training", 100.0)
    clock.mark(0, "switching", 104.0)
    clock.mark(0, "training", 105.0)
    clock.mark(1, "switching", 107.0)
    clock.mark(1, "sampling", 107.5)
    window = clock.take(110.0)
    assert window == {
        0: {"sampling": 4.0, "training": 5.0, "switching": 1.0, "idle": 0.0},
        1: {"sampling": 2.5, "training": 7.0, "switching": 0.5, "idle": 0.0},
    }
    # Cell 0's 4 slots held 10 call-seconds while it sampled: 2.5 s of 4 busy; it computed 3 s.
    split = cell_time(window[0], computed_s=3.0, busy_slot_s=10.0, capacity=4)
    assert split.as_dict() == dict(zip(CATEGORIES, (2.5, 1.5, 3.0, 2.0, 1.0), strict=True))
    assert split.total == pytest.approx(10.0)
    # Measured work beyond its state is cut to it: never more than the window.
    assert cell_time(window[1], computed_s=99.0, busy_slot_s=99.0, capacity=1).total == pytest.approx(10.0)
    assert clock.take(112.0) == {
        0: {"sampling": 0.0, "training": 2.0, "switching": 0.0, "idle": 0.0},
        1: {"sampling": 2.0, "training": 0.0, "switching": 0.0, "idle": 0.0},
    }
