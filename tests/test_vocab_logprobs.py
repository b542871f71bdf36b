"""Log-probs from hidden states in chunks of rows: the unchunked rule's values and gradients,
padding columns left out, and the trainers' micro-step unchanged by the chunk size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre_hpc.loss.vocab_logprobs import full_logprobs, selected_logprobs
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.sequences import TrainSequence


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_log_probs_and_gradients_equal_the_whole_logits_rule(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g).requires_grad_()
    weight = torch.randn(300, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 300, (50,), generator=g)
    upstream = torch.randn(50, generator=g)

    logp, entropy = selected_logprobs(hidden, weight, targets, chunk=chunk)
    (logp * upstream).sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = full_logprobs(hidden @ weight.t(), targets)
    (ref_logp * upstream).sum().backward()

    assert torch.allclose(logp, ref_logp, atol=1e-5)
    assert torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert torch.allclose(got[0], hidden.grad, atol=1e-6) and torch.allclose(got[1], weight.grad, atol=1e-6)
    assert not entropy.requires_grad


def test_padding_columns_beyond_the_vocabulary_take_no_probability() -> None:
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 33, (9,), generator=g)
    logp, entropy = selected_logprobs(hidden, weight, targets, chunk=4, vocab=33)
    ref_logp, ref_entropy = full_logprobs(hidden @ weight[:33].t(), targets)
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)


def test_no_rows_is_an_empty_answer_that_keeps_the_graph() -> None:
    hidden, weight = torch.zeros(0, 8, requires_grad=True), torch.ones(5, 8, requires_grad=True)
    logp, entropy = selected_logprobs(hidden, weight, torch.zeros(0, dtype=torch.int64))
    assert logp.shape == entropy.shape == (0,)
    logp.sum().backward()
    assert float(weight.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("packing", ["paths", "tree"])
def test_the_torch_trainer_s_step_does_not_depend_on_the_chunk(tmp_path: Path, packing: str) -> None:
    """A micro-step with one row per chunk equals one with every row in one chunk, and the loss
    reads only loss tokens: changing a prompt token's behaviour log-prob changes nothing."""
    model = init_tiny(tmp_path / "tiny")
    rng = np.random.default_rng(0)
    seqs = []
    for run in range(2):
        n = 40 + 9 * run
        mask = (np.arange(n) > 20).astype(np.float32)
        behaviour = np.where(mask > 0, -rng.random(n) * 3, 0).astype(np.float32)
        seqs.append(TrainSequence(f"r{run}", rng.integers(3, 200, n), mask, behaviour, 1.0 - 2 * run, 1 / 19))
    steps = []
    for chunk in (1, 4096):
        trainer = TorchTrainer(model, TrainerConfig(logprob_chunk=chunk), core=True, packing=packing)
        stats = trainer.micro_step(seqs)
        steps.append((stats.loss_sum, stats.token_stats, trainer.gradient().copy()))
    (loss_a, stats_a, grad_a), (loss_b, stats_b, grad_b) = steps
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert stats_a.entropy_sum == pytest.approx(stats_b.entropy_sum, rel=1e-6)
    assert np.abs(grad_a - grad_b).max() <= 1e-6 * max(np.abs(grad_b).max(), 1e-12)
    prompt_changed = [
        dataclasses.replace(s, behaviour_logprobs=s.behaviour_logprobs - (s.loss_mask == 0)) for s in seqs
    ]
    trainer = TorchTrainer(model, TrainerConfig(logprob_chunk=8), core=True, packing=packing)
    assert trainer.micro_step(prompt_changed).loss_sum == pytest.approx(loss_a, rel=1e-6)
