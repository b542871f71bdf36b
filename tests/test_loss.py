"""The weighted policy loss: any partition into micro-steps gives the unsplit loss and gradient."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre_hpc.loss.policy_loss import (
    Surrogate,
    policy_terms,
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
    ).loss


def random_batch(seed: int, loss_mean: str = "run") -> Batch:
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
    return build_batch(selected, advantages, loss_mean)


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
    loss = policy_terms(logp, behaviour, adv, rule, fresh).loss
    assert loss.tolist() == pytest.approx([-0.5, -2.0, -0.5, -1.28])
    loss.sum().backward()
    # fresh: −w·A; stale: d(−r·A)/d log π = −r·A inside the clip, 0 once clipped (r = 3 > 1.28)
    assert logp.grad.tolist() == pytest.approx([-0.5, -2.0, -0.5, 0.0])
    # without the correction every token is under the clip, fresh or not
    plain = policy_terms(logp.detach(), behaviour, adv, Surrogate(), fresh).loss
    assert plain.tolist() == pytest.approx([-0.5, -1.28, -0.5, -1.28])


def test_a_dual_clip_of_one_or_less_is_refused_in_one_line() -> None:
    from conftest import REPO

    from gyre_hpc.errors import RecipeError
    from gyre_hpc.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"trainer.dual_clip = 0.5 must be 0 \(off\) or above 1"):
        load_recipe(REPO / "recipes" / "smoke.toml", ["trainer.dual_clip=0.5"])


# ---- mismatch corrections, objectives, baselines, means -------------------------------------------


def fresh_terms(gaps: list[float], rule: Surrogate, segments: list[int] | None = None, adv: float = 1.0):  # noqa: ANN201
    """Loss tokens all sampled at the version trained, log π − log μ = ``gaps``."""
    behaviour = torch.zeros(len(gaps))
    logp = torch.tensor(gaps).requires_grad_()
    segs = None if segments is None else torch.tensor(segments)
    ones = torch.ones(len(gaps))
    return logp, weighted_policy_loss(logp, behaviour, adv * ones, ones / len(gaps), ones, rule,
                                      ones.bool(), segs)  # fmt: skip


def test_mis_rejects_tokens_outside_its_bounds_and_they_leave_the_denominator() -> None:
    """slime #657's example: of five tokens three lie outside [0.5, 2]; the loss is the mean over
    the two kept of −(π/μ)·A, not their sum over five, and the rejected ones get no gradient."""
    gaps = [0.1, -1.5, 0.8, -10.0, 0.3]
    logp, (loss, rejected) = fresh_terms(gaps, Surrogate(mismatch_correction="mis", mismatch_low=0.5))
    assert rejected.tolist() == [False, True, True, True, False]
    kept = [math.exp(0.1), math.exp(0.3)]
    assert float(loss.detach()) == pytest.approx(-sum(kept) / 2)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-kept[0] / 2, 0, 0, 0, -kept[1] / 2])


def test_sequence_tis_weights_a_path_s_fresh_tokens_by_its_truncated_ratio() -> None:
    gaps = [0.2, 0.1, -0.1, 1.0, 0.5]  # path 0: Σ 0.2 → w = e^0.2; path 1: Σ 1.5 → capped at 2
    rule = Surrogate(mismatch_correction="sequence-tis", mismatch_cap=2.0)
    logp, (loss, rejected) = fresh_terms(gaps, rule, [0, 0, 0, 1, 1])
    assert not rejected.any()
    assert float(loss.detach()) == pytest.approx(-(3 * math.exp(0.2) + 2 * 2.0) / 5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-math.exp(0.2) / 5] * 3 + [-2.0 / 5] * 2)


def test_sequence_mis_weights_a_path_by_its_ratio_or_rejects_it() -> None:
    gaps = [0.2, 0.1, 0.5, 0.6]  # path 0: Π = e^0.3 kept, weight e^0.3; path 1: e^1.1 > 2, rejected
    rule = Surrogate(mismatch_correction="sequence-mis", mismatch_low=0.5, mismatch_cap=2.0)
    logp, (loss, rejected) = fresh_terms(gaps, rule, [0, 0, 1, 1])
    assert rejected.tolist() == [False, False, True, True]
    assert float(loss.detach()) == pytest.approx(-2 * math.exp(0.3) / 4)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-math.exp(0.3) / 4] * 2 + [0.0, 0.0])


def test_a_geometric_mask_rejects_a_whole_path_and_keeps_the_other() -> None:
    gaps = [0.001, -0.002, 0.5, 0.1]  # path 0: geometric mean e^−0.0005, in band; path 1: e^0.3, out
    rule = Surrogate(mismatch_correction="geometric-mask", mismatch_low=0.99, mismatch_cap=1.01)
    logp, (loss, rejected) = fresh_terms(gaps, rule, [0, 0, 1, 1])
    assert rejected.tolist() == [False, False, True, True]
    assert float(loss.detach()) == pytest.approx(-2 / 4)  # on-policy ratio 1 for the kept, weight unchanged
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0])


def test_stale_tokens_are_never_rejected_nor_reweighted() -> None:
    behaviour = torch.zeros(2)
    logp = torch.tensor([3.0, 3.0]).requires_grad_()
    fresh = torch.tensor([True, False])
    rule = Surrogate(mismatch_correction="mis")
    loss = policy_terms(logp, behaviour, torch.ones(2), rule, fresh).loss
    assert loss.tolist() == pytest.approx(
        [0.0, -1.28]
    )  # the fresh one rejected (e^3 > 2), the stale one clipped


def test_gspo_shares_one_clipped_ratio_per_path() -> None:
    """Path 0's mean log-ratio 0.05 gives every token r = e^0.05, inside the clip: loss −r·A and
    gradient −r·A per token; path 1's e^0.5 is clipped for A > 0: loss −1.28·A, no gradient."""
    behaviour = torch.zeros(4)
    logp = torch.tensor([0.0, 0.1, 0.4, 0.6]).requires_grad_()
    segs = torch.tensor([0, 0, 1, 1])
    loss = policy_terms(logp, behaviour, torch.ones(4), Surrogate(objective="gspo"), None, segs).loss
    r = math.exp(0.05)
    assert loss.tolist() == pytest.approx([-r, -r, -1.28, -1.28])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-r, -r, 0.0, 0.0])


def test_cispo_keeps_the_gradient_of_a_clipped_token() -> None:
    behaviour = torch.zeros(2)
    logp = torch.tensor([0.1, 1.0]).requires_grad_()
    loss = policy_terms(logp, behaviour, torch.ones(2), Surrogate(objective="cispo"), None).loss
    assert loss.tolist() == pytest.approx([-math.exp(0.1), -1.28])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-math.exp(0.1), -1.28])  # PPO's would be 0 for the second


def test_a_custom_policy_loss_by_import_path_and_its_one_line_refusals(tmp_path: Path) -> None:
    from conftest import REPO

    from gyre_hpc.errors import RecipeError
    from gyre_hpc.recipe import load_recipe

    good = tmp_path / "myloss.py"
    good.write_text(
        "def reinforce(logprobs, anchor, advantages, segments, rule):\n    return -advantages * logprobs\n"
    )
    recipe = load_recipe(REPO / "recipes" / "smoke.toml", [f"trainer.policy_loss={good}:reinforce"])
    rule = Surrogate.of(recipe.trainer)
    logp = torch.tensor([0.5, -0.5]).requires_grad_()
    assert policy_terms(logp, torch.zeros(2), torch.tensor([1.0, -2.0]), rule).loss.tolist() == pytest.approx(
        [-0.5, -1.0]
    )
    (tmp_path / "bad.py").write_text("def loss(logprobs):\n    return logprobs\n")
    cases = {
        "nowhere.module:fn": r"policy_loss = 'nowhere.module:fn' does not import: No module named 'nowhere'",
        f"{tmp_path / 'bad.py'}:loss": r"must be a function of \(logprobs, anchor, advantages, segments",
        "reinforce": r"not a built-in loss; valid: ppo, gspo, cispo or module:function",
    }
    for value, message in cases.items():
        with pytest.raises(RecipeError, match=message):
            load_recipe(REPO / "recipes" / "smoke.toml", [f"trainer.policy_loss={value}"])


def test_rloo_subtracts_the_mean_of_the_other_runs() -> None:
    from gyre_hpc.trajectory.sequences import group_advantages

    assert group_advantages([1.0, 0.0, 0.0, 0.0], baseline="rloo") == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3]
    )
    assert group_advantages([1.0], baseline="rloo") == [0.0]
    std = group_advantages([1.0, 0.0], std_normalize=True, baseline="rloo")
    assert std == pytest.approx([2.0, -2.0], rel=1e-5)  # (1 − 0) / 0.5


@pytest.mark.parametrize("mean", ["token", "sequence"])
def test_token_and_sequence_means_divide_by_tokens_or_paths(mean: str) -> None:
    from gyre_hpc.trajectory.sequences import loss_divisor

    batch = random_batch(3, mean)
    rng = np.random.default_rng(3)
    per_token = [rng.uniform(-1, 1, len(s)) for s in batch.sequences]
    masks = [np.asarray(s.loss_mask) > 0 for s in batch.sequences]
    total = sum(
        (x * s.token_weight)[m].sum() for s, x, m in zip(batch.sequences, per_token, masks, strict=True)
    )
    values = [x[m] for x, m in zip(per_token, masks, strict=True)]
    expect = np.concatenate(values).mean() if mean == "token" else np.mean([v.mean() for v in values])
    assert total / batch.divisor == pytest.approx(expect)
    assert batch.divisor == loss_divisor(batch.sequences, mean) > batch.num_runs
