"""From selected paths and rewards to weighted training sequences packed into micro-steps.

Advantages are group-relative over the runs of one prompt and inherited by every selected
path of a run. The loss is a mean written as per-token weights and one divisor applied when the
batch gradient is complete (``trajectory.loss_mean``):

```
 run (the paper's two-level mean)   weight 1/T_run    divisor R, runs with loss tokens
 token                              weight 1          divisor T, loss tokens
 sequence                           weight 1/T_path   divisor P, paths
```

A sum over any partition of the sequences into micro-steps, trained on any cells, then equals
the unsplit loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gyre_hpc.trajectory.select import SelectedPath


def group_advantages(
    rewards: Sequence[float], std_normalize: bool = False, eps: float = 1e-6, baseline: str = "mean"
) -> list[float]:
    """Rewards of one prompt's group less a baseline — the group's mean, or (``rloo``) the mean
    of the other runs' — optionally divided by the group's std."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return []
    adv = r - r.mean()
    if baseline == "rloo":
        adv = adv * r.size / (r.size - 1) if r.size > 1 else adv * 0.0
    if std_normalize:
        adv = adv / (r.std() + eps)
    return adv.tolist()


@dataclass(frozen=True, eq=False)
class TrainSequence:
    run_id: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantage: float
    token_weight: float
    """``1/T_run`` (T_run = the run's selected trainable tokens over all its paths), or as
    ``trajectory.loss_mean`` says."""
    versions: np.ndarray | None = None
    """The policy version that generated each loss token (where ``loss_mask`` is set)."""
    routes: np.ndarray | None = None
    """[len, layers, top-k]: the experts the engine routed each position to (-1: none known),
    which a trainer replaying routes sends it through; None for a dense model."""

    def __len__(self) -> int:
        return len(self.tokens)


MicroStep = list[TrainSequence]
"""The sequences one forward and backward pass trains (at most ``trainer.micro_step_tokens``, or
one longer path on its own)."""
StepQueue = list[MicroStep]
"""A step's micro-steps in claim order: what its trainers claim one index at a time
(``step.claims``), handed over as it grows (``scheduler.fleet.Fleet``)."""


@dataclass(frozen=True)
class Batch:
    sequences: list[TrainSequence]
    num_runs: int
    """R: runs that contribute tokens."""
    divisor: int = 0
    """What the summed gradient is divided by once, at the end (``loss_divisor``)."""


def loss_divisor(sequences: Sequence[TrainSequence], loss_mean: str = "run") -> int:
    """The divisor of the summed loss of ``sequences`` under ``trajectory.loss_mean``: runs, loss
    tokens or paths (a run split between two updates counts in both)."""
    if loss_mean == "token":
        return int(sum(int(np.count_nonzero(s.loss_mask)) for s in sequences))
    if loss_mean == "sequence":
        return len(sequences)
    return len({s.run_id for s in sequences})


def build_batch(
    paths_by_run: Mapping[str, Sequence[SelectedPath]],
    advantages: Mapping[str, float],
    loss_mean: str = "run",
) -> Batch:
    sequences = []
    runs = 0
    for run_id, paths in paths_by_run.items():
        total = sum(p.num_loss_tokens for p in paths)
        if total == 0:
            continue  # nothing to learn from (e.g. a placeholder run): it counted in its group only
        runs += 1
        for p in paths:
            if p.num_loss_tokens:
                sequences.append(
                    TrainSequence(
                        run_id,
                        p.tokens,
                        p.loss_mask,
                        p.logprobs,
                        advantages[run_id],
                        {"run": 1.0 / total, "token": 1.0, "sequence": 1.0 / p.num_loss_tokens}[loss_mean],
                        p.versions,
                        p.routes,
                    )
                )
    return Batch(sequences, runs, loss_divisor(sequences, loss_mean))


def pack_micro_steps(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices grouped into micro-steps of at most ``max_tokens``.

    A sequence longer than ``max_tokens`` gets a micro-step of its own. Only bins with room for
    the shortest sequence are searched (no other could take any), so equal sequences that fill a
    micro-step each pack in linear time.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    smallest = min(lengths, default=0)
    bins: list[list[int]] = []
    room: list[int] = []
    open_: list[int] = []
    """The bins that can still take the shortest sequence, in the order they were opened."""
    for i in order:
        n = lengths[i]
        for k, b in enumerate(open_):
            if n <= room[b]:
                bins[b].append(i)
                room[b] -= n
                if room[b] < smallest:
                    del open_[k]
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
            if room[-1] >= smallest:
                open_.append(len(bins) - 1)
    return bins
