"""The weighted policy loss: any partition into micro-steps gives the unsplit loss and gradient."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gyre_hpc.loss.policy_loss import (
    Surrogate,
    policy_loss,
    ppo_clip_loss,
    token_logprobs,
    weighted_policy_loss,
)
from gyre_hpc.trajectory import TitoRecord, TrajectoryTree, select_paths
from gyre_hpc.trajectory.sequences import Batch, TrainSequence, build_batch, pack_micro_steps

VOCAB = 32


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))


def sequence_loss(model: torch.nn.Module, seq: TrainSequence) -> torch.Tensor:
    tokens = torch.as_tensor(seq.tokens, dtype=torch.long)
    logp = token_logprobs(model(tokens), tokens)
    mask = torch.as_tensor(seq.loss_mask, dtype=torch.float32)
    behaviour = torch.as_tensor(seq.behaviour_logprobs)
    adv = torch.full_like(logp, seq.advantage)
    return weighted_policy_loss(
        logp, behaviour, adv, torch.full_like(logp, seq.token_weight), mask, Surrogate()
    )


def random_batch(seed: int) -> Batch:
    rng = random.Random(seed)
    selected, advantages = {}, {}
    for run in range(4):
        records, ctx = [], [1, 2]
        for call in range(rng.randint(1, 4)):
            out = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
            records.append(
                TitoRecord(f"run{run}", f"c{call}", "main", ctx, out, [-rng.random() * 3 for _ in out])
            )
            ctx = (
                ctx + out + [rng.randrange(3, VOCAB)]
                if rng.random() < 0.7
                else ctx[:2] + [rng.randrange(3, 9)]
            )
        selected[f"run{run}"] = select_paths(TrajectoryTree.from_records(records), jmax=3, rng=rng)
        advantages[f"run{run}"] = rng.uniform(-1, 1)
    return build_batch(selected, advantages)


def grads_and_loss(batch: Batch, groups: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    model = tiny_model()
    total = 0.0
    for group in groups:  # one micro-step each: sum, backward, accumulate
        loss = sum(sequence_loss(model, batch.sequences[i]) for i in group)
        loss.backward()
        total += float(loss.detach())
    for p in model.parameters():  # the 1/R factor, once the batch gradient is complete
        p.grad /= batch.num_runs
    return total / batch.num_runs, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_micro_step_partition_does_not_change_loss_or_gradient(seed: int) -> None:
    batch = random_batch(seed)
    n = len(batch.sequences)
    whole_loss, whole_grads = grads_and_loss(batch, [list(range(n))])
    rng = random.Random(seed)
    for max_tokens in (8, 20, 1000):
        order = list(range(n))
        rng.shuffle(order)
        groups = pack_micro_steps([len(batch.sequences[i]) for i in order], max_tokens)
        groups = [[order[i] for i in g] for g in groups]
        loss, grads = grads_and_loss(batch, groups)
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
        for a, b in zip(grads, whole_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_unsplit_loss_is_the_mean_over_runs_of_the_mean_over_tokens() -> None:
    batch = random_batch(7)
    model = tiny_model()
    per_run: dict[str, list[torch.Tensor]] = {}
    for seq in batch.sequences:
        tokens = torch.as_tensor(seq.tokens, dtype=torch.long)
        logp = token_logprobs(model(tokens), tokens)
        loss = ppo_clip_loss(
            logp,
            torch.as_tensor(seq.behaviour_logprobs),
            torch.full_like(logp, seq.advantage),
            0.2,
            0.28,
            3.0,
        )
        per_run.setdefault(seq.run_id, []).append(loss[torch.as_tensor(seq.loss_mask)])
    expected = np.mean([float(torch.cat(v).mean().detach()) for v in per_run.values()])
    got = float(sum(sequence_loss(model, s) for s in batch.sequences).detach()) / batch.num_runs
    assert got == pytest.approx(expected, rel=1e-5)


def test_ppo_clip() -> None:
    behaviour = torch.zeros(3)
    logp = torch.log(torch.tensor([0.5, 1.0, 2.0]))
    adv = torch.ones(3)
    assert ppo_clip_loss(logp, behaviour, adv, 0.2, 0.28).tolist() == pytest.approx([-0.5, -1.0, -1.28])
    assert ppo_clip_loss(logp, behaviour, -adv, 0.2, 0.28).tolist() == pytest.approx([0.8, 1.0, 2.0])


def test_dual_clip_bounds_a_negative_advantage_s_loss() -> None:
    """PPO's clip leaves −r·A unbounded when A < 0 and r ≫ 1; the dual clip caps it at c·|A|
    (and leaves positive advantages alone)."""
    behaviour = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.0, 2.0, 5.0]))
    neg, pos = -torch.ones(4), torch.ones(4)
    assert ppo_clip_loss(logp, behaviour, neg, 0.2, 0.28).tolist() == pytest.approx([0.8, 1.0, 2.0, 5.0])
    assert ppo_clip_loss(logp, behaviour, neg, 0.2, 0.28, 3.0).tolist() == pytest.approx([0.8, 1.0, 2.0, 3.0])
    assert ppo_clip_loss(logp, behaviour, 2 * neg, 0.2, 0.28, 3.0)[3] == pytest.approx(6.0)  # c·|A|
    assert ppo_clip_loss(logp, behaviour, pos, 0.2, 0.28, 3.0).tolist() == pytest.approx(
        [-0.5, -1.0, -1.28, -1.28]
    )


def test_tis_trains_same_version_tokens_on_policy_weighted_by_the_truncated_ratio() -> None:
    """A token sampled at the version trained: loss −min(π/μ, C)·A, its gradient −min(π/μ, C)·A
    with respect to log π (the clip cannot bind: its ratio to the weights trained is 1); a stale
    token keeps the clip against μ."""
    behaviour = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 3.0, 0.5, 3.0])).requires_grad_()
    adv = torch.ones(4)
    fresh = torch.tensor([True, True, False, False])
    rule = Surrogate(mismatch_correction="tis", mismatch_cap=2.0)
    loss = policy_loss(logp, behaviour, adv, rule, fresh)
    assert loss.tolist() == pytest.approx([-0.5, -2.0, -0.5, -1.28])
    loss.sum().backward()
    # fresh: −w·A; stale: d(−r·A)/d log π = −r·A inside the clip, 0 once clipped (r = 3 > 1.28)
    assert logp.grad.tolist() == pytest.approx([-0.5, -2.0, -0.5, 0.0])
    # without the correction every token is under the clip, fresh or not
    plain = policy_loss(logp.detach(), behaviour, adv, Surrogate(), fresh)
    assert plain.tolist() == pytest.approx([-0.5, -1.28, -0.5, -1.28])


def test_a_dual_clip_of_one_or_less_is_refused_in_one_line() -> None:
    from conftest import REPO

    from gyre_hpc.errors import RecipeError
    from gyre_hpc.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"trainer.dual_clip = 0.5 must be 0 \(off\) or above 1"):
        load_recipe(REPO / "recipes" / "smoke.toml", ["trainer.dual_clip=0.5"])
