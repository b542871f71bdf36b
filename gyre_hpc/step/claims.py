"""The claim queue: one cell's part of one step's micro-steps, claimed one index at a time.

```
 work_once: i = claim()  (fetch-and-add on the step's one counter)
            i < known length           → micro_step(queue[i])        trained
            queue closed and i ≥ total → gradient()                  done
            step stopped (carry_tail)  → gradient()                  done
            else                       → keep i; more micro-steps come   waiting
```

Faster or earlier cells take more micro-steps; each index is trained exactly once because the
counter hands it out once. A cell's loop (``runtime.cell_leader``) and the simulated fleet
(``sim.fleet``) both claim through ``work_once``. Pure: it knows nothing of MPI, models or time
beyond the seconds a micro-step took; the counter and the trainer are interfaces.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.trajectory.sequences import MicroStep, StepQueue, TrainSequence


@dataclass(frozen=True)
class MicroStats:
    sequences: int
    tokens: int
    loss_tokens: int
    loss_sum: float
    """Σ weight·loss of the micro-step (divide by R for its share of the batch loss)."""
    token_stats: TokenStats = TokenStats()
    """Clipping, KL, entropy and log-prob mismatch over its loss tokens (sums)."""

    @property
    def clipped(self) -> int:
        """Loss tokens whose importance ratio was clipped."""
        return self.token_stats.clipped


def micro_stats(
    sequences: list[TrainSequence],
    loss_sum: float,
    stats: TokenStats | None = None,
    tokens: int | None = None,
) -> MicroStats:
    """A micro-step's counts; the loss and token stats come from wherever it was computed, and
    ``tokens`` (forwarded) defaults to the paths' lengths."""
    tokens = sum(len(s) for s in sequences) if tokens is None else tokens
    loss_tokens = int(sum(float(np.asarray(s.loss_mask).sum()) for s in sequences))
    return MicroStats(len(sequences), tokens, loss_tokens, loss_sum, stats or TokenStats())


class Counter(Protocol):
    def claim(self) -> int:
        """The next index of the step's queue (fetch-and-add: each index once)."""


class MicroStepper(Protocol):
    """What ``work_once`` asks of a trainer."""

    def micro_step(self, sequences: list[TrainSequence]) -> MicroStats: ...

    def gradient(self) -> object:
        """What it accumulated, where the core reads it."""


@dataclass
class Claims:
    """One cell's part of one step's queue: what it knows of the queue and what it claimed.

    The queue may still grow (elastic: micro-steps arrive as prompt groups complete) until it is
    closed with its final length.
    """

    queue: StepQueue
    closed: bool
    total: int = -1
    pending: int | None = None
    """An index taken from the counter whose micro-step has not arrived yet."""
    claimed: list[int] = field(default_factory=list)
    stats: list[MicroStats] = field(default_factory=list)
    stopped: bool = False
    """The step ended before the queue was exhausted: claim nothing more."""
    computed: float = 0.0
    """Seconds its micro-steps took (the rest of the session it waited)."""

    @classmethod
    def of(cls, queue: Sequence[MicroStep], closed: bool = True) -> Claims:
        return cls(list(queue), closed, len(queue) if closed else -1)

    def close(self, total: int, stop: bool = False) -> None:
        self.closed, self.total, self.stopped = True, total, stop

    @property
    def loss_sum(self) -> float:
        return sum(s.loss_sum for s in self.stats)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stats)

    @property
    def token_stats(self) -> TokenStats:
        return sum((s.token_stats for s in self.stats), TokenStats())


def work_once(claims: Claims, trainer: MicroStepper, counter: Counter) -> str:
    """Claim an index and train its micro-step: ``trained``, ``waiting`` (its micro-step is not
    packed yet) or ``done`` (the queue is closed and exhausted, or the step was stopped: an
    index claimed and not trained is reported by nobody, so the controller carries it)."""
    if claims.stopped:
        trainer.gradient()  # what it trained counts: it lands where the core reads it
        return "done"
    if claims.pending is None:
        claims.pending = counter.claim()
    i = claims.pending
    if i < len(claims.queue):
        started = time.monotonic()
        claims.stats.append(trainer.micro_step(claims.queue[i]))
        claims.computed += time.monotonic() - started
        claims.claimed.append(i)
        claims.pending = None
        return "trained"
    if claims.closed and i >= claims.total:
        trainer.gradient()  # what the trainer accumulated on its device lands where the core reads it
        return "done"
    return "waiting"
