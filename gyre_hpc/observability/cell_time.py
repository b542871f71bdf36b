"""Where a cell's time went: the categories ``bench sim`` draws, booked for a real run.

```
 a cell's role clock      sampling ──────────┬── switching ──┬── training (role) ──────┐
                                              drain · switch   load                    │
 what fills it            busy slots │ idle slots          compute │ idle (waiting)    │
 CellTime                 sampling   │ idle slots  switching  training │ idle          ─┘
```

``RoleClock`` books each cell's seconds in its role's states (sampling, training, switching) on
whatever clock it is given; ``cell_time`` splits a window's sampling by the busy share of the
cell's slots and its training role by the seconds it computed. The categories of one window sum
to the window by construction of the role clock: every second of a cell is in exactly one state.

Pure: it knows nothing of engines, MPI or events; the controller feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

CATEGORIES = ("sampling", "idle slots", "training", "idle", "switching")
"""``sampling``: slots busy; ``idle slots``: the sampling role with its slots empty; ``training``:
computing micro-steps (and the core's apply); ``idle``: the training role waiting for work;
``switching``: draining, switching roles and loading weights."""
COLORS = {
    "sampling": "#4c72b0",
    "idle slots": "#a6bddb",
    "training": "#dd8452",
    "idle": "#cccccc",
    "switching": "#c44e52",
}
"""One colour per category, in every picture of cell time (``bench sim``'s and a run's)."""
STATES = ("sampling", "training", "switching", "idle")
"""A cell's states on the role clock: its role (idle: neither role yet), or between roles."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CellTime:
    """Where one cell's time went in a window (a run's step, or a whole simulated run), by
    category: what every picture of cell time draws, in the runtime and the simulator alike."""

    sampling: float = 0.0
    idle_slots: float = 0.0
    training: float = 0.0
    idle: float = 0.0
    switching: float = 0.0

    def as_dict(self, digits: int | None = 3) -> dict[str, float]:
        """By category name (``CATEGORIES``), rounded to ``digits`` (the millisecond; None: as is)."""
        values = (self.sampling, self.idle_slots, self.training, self.idle, self.switching)
        return {
            name: v if digits is None else round(v, digits)
            for name, v in zip(CATEGORIES, values, strict=True)
        }

    @property
    def total(self) -> float:
        return self.sampling + self.idle_slots + self.training + self.idle + self.switching


class RoleClock:
    """Each cell's seconds in each state since the last ``take``. Not thread-safe: one owner."""

    def __init__(self, now: float) -> None:
        self.since = now
        self._state: dict[int, str] = {}
        self._entered: dict[int, float] = {}
        self._seconds: dict[int, dict[str, float]] = {}

    def mark(self, cell: int, state: str, now: float) -> None:
        """``cell`` is in ``state`` from ``now`` on (a first mark starts its book at ``since``)."""
        if state not in STATES:
            raise ValueError(f"cell state {state!r}; valid: {', '.join(STATES)}")
        self._close(cell, now)
        self._state[cell] = state

    def state(self, cell: int) -> str | None:
        return self._state.get(cell)

    def _close(self, cell: int, now: float) -> None:
        book = self._seconds.setdefault(cell, dict.fromkeys(STATES, 0.0))
        if cell in self._state:
            book[self._state[cell]] += max(now - self._entered[cell], 0.0)
        self._entered[cell] = now if cell in self._state else self.since

    def take(self, now: float) -> dict[int, dict[str, float]]:
        """Each cell's seconds per state from ``since`` to ``now``; the next window starts now."""
        for cell in list(self._state):
            self._close(cell, now)
        out = {c: dict(b) for c, b in sorted(self._seconds.items()) if c in self._state}
        self._seconds = {c: dict.fromkeys(STATES, 0.0) for c in self._state}
        self._entered = dict.fromkeys(self._state, now)
        self.since = now
        return out


def cell_time(states: dict[str, float], computed_s: float, busy_slot_s: float, capacity: int) -> CellTime:
    """One cell's window: its seconds per state, the seconds it computed while training, and its
    slots' busy slot-seconds (∫ calls in flight dt) while sampling. Measured busy time beyond its
    state (a call finishing during the drain; a micro-step across the window's edge) is cut to it."""
    sampling = states.get("sampling", 0.0)
    training = states.get("training", 0.0)
    busy = min(busy_slot_s / capacity, sampling) if capacity > 0 else 0.0
    computed = min(computed_s, training)
    idle = training - computed + states.get("idle", 0.0)
    return CellTime(
        sampling=busy,
        idle_slots=sampling - busy,
        training=computed,
        idle=idle,
        switching=states.get("switching", 0.0),
    )


def cell_totals(splits: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The seconds of several windows (or cells), by category (``CellTime.as_dict``'s keys)."""
    total = dict.fromkeys(CATEGORIES, 0.0)
    for split in splits:
        for what in CATEGORIES:
            total[what] += split.get(what, 0.0)
    return total


class CellHours:
    """A fleet's cells, booked: the role clock (marked by the fleet as cells switch, load and
    take roles) and the seconds each cell computed (reported by its trainer), cut into windows
    with the busy slot-seconds of its engines."""

    def __init__(self, now: float) -> None:
        self.clock = RoleClock(now)
        self.computed: dict[int, float] = {}

    def mark(self, cell: int, state: str, now: float) -> None:
        self.clock.mark(cell, state, now)

    def add_computed(self, cell: int, seconds: float) -> None:
        self.computed[cell] = self.computed.get(cell, 0.0) + seconds

    def take(
        self, now: float, busy_slot_s: dict[int, float], capacity: dict[int, int]
    ) -> dict[int, CellTime]:
        """Each cell's window since the last ``take`` (``busy_slot_s``: its engines' slot-seconds
        in the window; ``capacity``: its slots)."""
        states = self.clock.take(now)
        out = {
            c: cell_time(s, self.computed.get(c, 0.0), busy_slot_s.get(c, 0.0), capacity.get(c, 0))
            for c, s in states.items()
        }
        self.computed = {}
        return out
