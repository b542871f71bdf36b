"""What a step kind asks of its cells, and what they report back: the ``Fleet`` it drives.

```
 step kind ──switch · load_weights · train / extend / close_queue · apply──▶ Fleet
           ◀──────── Hello (start) · TrainDone (receive) · StepApplied ─────┘
```

``runtime.fleet.MpiFleet`` carries these over MPI to cell leaders (``runtime.protocol``); the
simulator carries them on a simulated clock. This module holds only the interface and two of the
reports (a cell's ``Hello`` is the event it is recorded as); it knows nothing of MPI, ranks or
time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gyre_hpc.loss.token_stats import TokenStats
from gyre_hpc.observability.events import Hello
from gyre_hpc.scheduler.policy import Role
from gyre_hpc.step.claims import Claims
from gyre_hpc.trajectory.sequences import StepQueue


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainDone:
    """A training cell is done with a step: what it claimed and trained."""

    cell: int
    step: int
    claimed: list[int]
    loss_sum: float
    tokens: int
    stats: TokenStats
    """Clipping, KL, entropy and log-prob mismatch over the cell's trained tokens (sums)."""
    seconds: float
    """From joining the step to finishing it, waiting included."""
    computed: float = 0.0
    """Of them, the seconds its micro-steps took."""

    @classmethod
    def of(cls, cell: int, step: int, claims: Claims, seconds: float) -> TrainDone:
        """A cell's report of its claims, ``seconds`` after it joined the step."""
        return cls(
            cell=cell,
            step=step,
            claimed=claims.claimed,
            loss_sum=claims.loss_sum,
            tokens=claims.tokens,
            stats=claims.token_stats,
            seconds=seconds,
            computed=claims.computed,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepApplied:
    """The core applied a step and published ``version``."""

    step: int
    version: int
    grad_norm: float
    seconds: float
    checkpoint: str


class ProtocolError(RuntimeError):
    """A peer sent something that is not a protocol message, or nothing in time."""


class Fleet(Protocol):
    units: dict[int, Hello]
    """Every cell and standalone engine, by unit number, once ``start`` returned."""
    cells: int
    """Units 0 … cells-1 are cells (cell 0 the core); the rest are standalone engines."""
    roles: dict[int, Role]
    version: int
    """The version the core has published."""

    def start(self) -> None:
        """Wait for every unit's Hello."""

    def switch(self, roles: dict[int, Role]) -> dict[int, float]:
        """Give cells new roles at once and wait until every rank of each has taken its role;
        seconds per switched cell (a cell already in its role is left alone)."""

    def load_weights(self, units: list[int]) -> float:
        """Every listed engine loads the current version; the slowest one's seconds."""

    def train(self, cells: list[int], step: int, queue: StepQueue, closed: bool) -> None:
        """Cells join ``step`` from the current version and claim from ``queue`` (more may follow
        with ``extend`` until ``close_queue`` unless ``closed``)."""

    def extend(self, cells: list[int], step: int, items: StepQueue) -> None: ...

    def close_queue(self, cells: list[int], step: int, total: int, stop: bool) -> None: ...

    def reset_claims(self) -> None:
        """The claim counter back to 0, while nobody claims (between steps)."""

    def claimed(self) -> int:
        """Claims handed out from the current queue."""

    def receive(self) -> TrainDone | None:
        """The next TrainDone, or None after a short wait; a silent cell raises ``CellLost``."""

    def apply(
        self, step: int, done: dict[int, TrainDone], num_runs: int, checkpoint: bool, state: dict
    ) -> StepApplied:
        """The core sums the gradients of the cells in ``done``, steps (unless ``num_runs`` is 0),
        publishes the next version and checkpoints if asked; ``version`` follows."""

    def shutdown(self, reason: str) -> None: ...
