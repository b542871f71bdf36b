"""Fault points: places in the runtime where a test makes a rank (or a proxy worker) die at the
moment it names.

```
 GYRE_FAULT="push@1,apply@1"        (read by launch.env, as every job variable is)
   rank 1, the first time it reaches `push` in this run directory: a marker faults/push@1, then
   SIGKILL — the rank dies as a killed one does, with no last words
   a restarted world finds the marker and goes past: each fault happens once, as a real one would
```

Points, and where a rank is when it dies at one:

 push         a cell leader, as it starts loading a version into its engine
 apply        the core, as it starts applying a step (before the gradients are summed)
 publish      the core, the step applied and its version published, before the controller hears of it
 checkpoint   the core, midway through a checkpoint: its files written, not yet renamed in place
 record       the controller, a step's record made, before it is written
 emit         the controller, the step's checkpoint marked recorded (the record in the mark), before
              the record is in the event log
 proxy        proxy worker N (``proxy.workers`` > 1; N is the worker's index, not a rank), a call's
              answer back from its engine, before it is recorded

With ``GYRE_FAULT`` unset every point does nothing. This module knows nothing of what a point is
in the middle of; the code that calls ``reach`` does.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.errors import GyreError

log = logging.getLogger(__name__)

POINTS = ("push", "apply", "publish", "checkpoint", "record", "emit", "proxy")


@dataclass(frozen=True)
class FaultPoints:
    armed: frozenset[str] = frozenset()
    """``POINT@RANK`` names, from ``GYRE_FAULT``."""
    rank: int = 0
    markers: Path | None = None
    """Where a fault that happened is marked (``RunDir.fault_markers``)."""

    @classmethod
    def of(cls, faults: tuple[str, ...], rank: int, markers: Path) -> FaultPoints:
        for fault in faults:
            point, _, at = fault.partition("@")
            if point not in POINTS or not at.isdigit():
                raise GyreError(
                    f"GYRE_FAULT names {fault!r}; valid: POINT@RANK, POINT one of {', '.join(POINTS)}"
                )
        return cls(frozenset(faults), rank, markers)

    def reach(self, point: str) -> None:
        """Die here if ``GYRE_FAULT`` names this point on this rank and it has not happened yet."""
        key = f"{point}@{self.rank}"
        if key not in self.armed or self.markers is None:
            return
        self.markers.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.markers / key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return  # it happened in an earlier world of this run
        log.warning("fault point %s: this rank dies here (GYRE_FAULT)", key)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
