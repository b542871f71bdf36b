"""What every trainer backend does (``torch`` here, ``megatron`` on GPU clusters).

```
  load_snapshot(flat, v) ─▶ micro_step(seqs) … micro_step(seqs) ─▶ gradient in the exposed buffer
  core only:  apply(R) = grad/R → clip → optimizer → flat weights of v+1 ─▶ publish
```

A trainer knows nothing about MPI, cells or the schedule: it owns a model replica (or, with
megatron, a rank's slice of one) whose weights it hands out as one flat float32 buffer in the
shared layout (``models.flat.FlatLayout``), and whose gradient is one contiguous block a rank:
the whole flat gradient where one rank holds the replica, else that rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from gyre_hpc.loss.diagnostics import token_stats
from gyre_hpc.loss.policy_loss import Surrogate, weighted_policy_loss
from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.step.claims import MicroStats, micro_stats
from gyre_hpc.trajectory.packing import PackedTree
from gyre_hpc.trajectory.sequences import TrainSequence


def mean_gradient_scale(sum_norm: float, num_runs: int, grad_clip: float) -> tuple[float, float]:
    """The norm of the mean gradient (a sum over ``num_runs`` runs whose norm is ``sum_norm``)
    and the factor that turns the sum into the clipped mean: one rule for every backend."""
    runs = max(num_runs, 1)
    norm, scale = sum_norm / runs, 1.0 / runs
    if grad_clip and norm > grad_clip:
        scale *= grad_clip / (norm + 1e-6)
    return norm, scale


@dataclass(frozen=True)
class ApplyStats:
    version: int
    grad_norm: float
    """Global gradient norm before clipping."""


class Trainer(Protocol):
    numel: int
    version: int

    def weights(self) -> np.ndarray:
        """The flat parameter buffer (a view, not a copy)."""

    def load_snapshot(self, flat: np.ndarray, version: int) -> None: ...

    def zero_grad(self) -> None: ...

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats:
        """Forward/backward; gradients accumulate (in the flat buffer, or on the trainer's device
        until ``gradient`` is asked)."""

    def gradient(self) -> np.ndarray:
        """This rank's gradient buffer (a view) holding every micro-step since ``zero_grad``: the
        whole flat gradient where one rank holds the replica, else this rank's slice in the
        backend's own cut (what the transport moves and the core sums); a collective on a
        replica of several ranks, asked of all of them."""

    def hf_gradient(self) -> np.ndarray:
        """The replica's whole gradient in the shared layout (``models.flat``), on its first
        rank: for inspecting and comparing backends, never on the training path."""

    def apply(self, num_runs: int) -> ApplyStats:
        """Core only: the summed gradient is in ``gradient()``; one optimizer step."""

    def save_weights(self, directory: Path) -> dict[str, str]:
        """Its weights written into ``directory`` (``trainer.weight_shards``: Hugging Face's
        ``model.safetensors`` when one rank holds them all, else each rank its shard): file
        name → sha256."""

    def load_weights(self, directory: Path, version: int) -> None:
        """Weights read from a checkpoint or model directory, whatever layout wrote them (each
        rank reads its slice; another layout's shards are resharded as they are read)."""

    def save_optimizer(self, directory: Path) -> dict[str, str]:
        """Its optimizer state written into ``directory`` (``trainer.state_files``: one file, or
        one per rank of a replica, each by its rank): file name → sha256."""

    def load_optimizer(self, directory: Path) -> None:
        """Its optimizer state read from ``directory`` (``ValueError``/``OSError`` when the files
        there are another trainer's shape)."""

    def release_memory(self) -> None:
        """Hand the GPU back while the cell samples (nothing to do on the CPU); ``weights`` still
        answers, from the snapshot taken before."""

    def resume_memory(self) -> None:
        """Take the GPU back before the cell trains."""


class SlicedTrainer(Trainer, Protocol):
    """A trainer whose ranks each hold a slice (megatron): its weights also move slice by slice."""

    def weight_slice(self) -> np.ndarray:
        """This rank's weights as bytes, as it keeps them (the training dtype)."""

    def load_slice(self, data: np.ndarray, version: int) -> None:
        """This rank's weights from a counterpart's ``weight_slice``."""


Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(hidden states of some rows [M, H], the token after each [M]) → (their log-probs [M], with the
gradient; the entropies of their distributions [M], without): the output layer and softmax in
chunks (``loss.vocab_logprobs``)."""


def policy_micro_step(
    sequences: list[TrainSequence],
    hidden_of: Callable[[torch.Tensor, TrainSequence], torch.Tensor],
    head: Head,
    rule: Surrogate,
    version: int | None = None,
    device: torch.device | None = None,
) -> MicroStats:
    """Forward/backward every sequence with the weighted policy loss, whatever the model:
    ``hidden_of(ids [1, T], sequence)`` gives the last hidden state of each position [T, H], and
    ``head`` the log-probs of the loss tokens from the rows before them, so no [T, vocab] logits
    exist. Gradients accumulate where autograd puts them; the backend moves them to its flat
    buffer. ``version`` is the one the model holds: tokens it sampled are the ones the log-prob
    mismatch is measured on."""
    loss_sum, stats = 0.0, TokenStats()
    for s in sequences:
        ids = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))[None].to(device)
        logp, entropy = loss_logprobs(hidden_of(ids, s), ids[0], s.loss_mask, head)
        loss, out = sequence_loss(s, logp, rule, version, entropy)
        loss.backward()
        loss_sum += float(loss.detach())
        stats += out
    return micro_stats(sequences, loss_sum, stats)


def loss_logprobs(
    hidden: torch.Tensor, tokens: torch.Tensor, loss_mask: np.ndarray, head: Head
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-prob (with its gradient) and entropy (without) of each loss token of a path [T]
    from the hidden states [T, H] of the positions before them; 0 elsewhere (position 0
    included, as ``loss.policy_loss.token_logprobs`` gives it)."""
    where = np.flatnonzero(np.asarray(loss_mask)[1:] > 0) + 1
    at = torch.from_numpy(where).to(hidden.device)
    picked, entropy = head(hidden[at - 1], tokens[at])
    zeros = torch.zeros(len(tokens), dtype=torch.float32, device=hidden.device)
    return zeros.scatter(0, at, picked), zeros.scatter(0, at, entropy)


def sequence_loss(
    s: TrainSequence,
    logp: torch.Tensor,
    rule: Surrogate,
    version: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """One sequence's weighted policy loss under ``rule`` from its token log-probs [T], and its
    token stats (the mismatch on tokens sampled at ``version``, the weights trained; entropy
    where given)."""
    device = logp.device
    mask = torch.from_numpy(np.asarray(s.loss_mask, dtype=np.float32)).to(device)
    behaviour = torch.from_numpy(np.asarray(s.behaviour_logprobs, dtype=np.float32)).to(device)
    adv = torch.full_like(logp, s.advantage)
    weights = torch.full_like(logp, s.token_weight)
    matched = None
    if version is not None and s.versions is not None:
        matched = torch.from_numpy(np.asarray(s.versions) == version).to(device)
    loss, rejected = weighted_policy_loss(logp, behaviour, adv, weights, mask, rule, matched)
    stats = token_stats(logp.detach(), behaviour, mask, rule.clip_low, rule.clip_high, matched, entropy)
    return loss, stats + TokenStats(masked=int(rejected.sum()))


def packed_loss(
    tree: PackedTree,
    logp: torch.Tensor,
    rule: Surrogate,
    version: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """A packed tree's weighted policy loss from its entries' log-probs [M] (``entry_rows``),
    and its entries' token stats: the sum of ``sequence_loss`` over the paths it packs."""
    device = logp.device
    behaviour = torch.from_numpy(tree.behaviour).to(device)
    adv = torch.from_numpy(tree.advantages).to(device)
    weights = torch.from_numpy(tree.weights).to(device)
    ones = torch.ones_like(logp)
    matched = None if version is None else torch.from_numpy(tree.versions == version).to(device)
    paths = torch.from_numpy(tree.entry_paths).to(device)
    loss, rejected = weighted_policy_loss(logp, behaviour, adv, weights, ones, rule, matched, paths)
    stats = token_stats(logp.detach(), behaviour, ones, rule.clip_low, rule.clip_high, matched, entropy)
    return loss, stats + TokenStats(masked=int(rejected.sum()))


def entry_rows(tree: PackedTree, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """Where each loss entry's log-prob is read: the logits row of its token's parent, the token
    itself, and whether it has a parent (a path's first token has none and gets log-prob 0, as
    ``loss.policy_loss.token_logprobs`` gives it)."""
    parents = tree.parents[tree.targets]
    rows = torch.from_numpy(np.maximum(parents, 0)).to(device)
    tokens = torch.from_numpy(tree.tokens[tree.targets]).to(device)
    return rows, tokens, torch.from_numpy(parents >= 0).to(device)


def tree_inputs(tree: PackedTree, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed tokens and their positions, each [1, N]."""
    ids = torch.from_numpy(tree.tokens)[None].to(device)
    return ids, torch.from_numpy(tree.positions)[None].to(device)
