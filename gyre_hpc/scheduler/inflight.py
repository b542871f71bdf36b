"""In-flight weight updates (``scheduler.max_staleness = k``): a step closes at its quota of
complete groups, not at its last execution. Pure; the runtime and the simulator both follow it.

```
 step s, trained from version u
   dispatch step s's prompts not yet dispatched, and the first ⌈lookahead · prompts⌉ of step s+1
     (first version u) · executions dispatched earlier keep running, on newer weights
   groups complete, from any burst ──▶ step s's queue (elastic streaming, the water-level rule)
   quota met (prompts_per_step complete groups)
     ──▶ stop every execution whose first version is ≤ u − k: it would land in step s+1 or later,
         trained more than k versions behind; it is partially scored like a timeout and its group
         joins step s
     ──▶ close the queue once they are in: train out, apply u+1 · the rest keep running
   barrier steps (the run's last, one that writes a checkpoint) look nothing ahead and wait for
   every execution
```

The look-ahead is what lets a step close early at all: with exactly one step's prompts in flight,
its quota is its whole burst. In the steady state each step dispatches one step's worth and
trains one step's worth, so the groups in flight beyond a step stay at the look-ahead.

Why stop rather than let a stale execution finish untrained: its tokens so far are within k, the
partial score is the one a timeout gets, and its slots go to fresh work instead of to tokens no
update would use. A stop is the only thing that ends an execution early: a weight update never
does (calls in flight complete on the engine, the next call is served by the new version), and
every execution that ends lands in exactly one step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

from gyre_hpc.recipe.schema import SchedulerConfig

K = TypeVar("K")


def in_flight(sched: SchedulerConfig) -> bool:
    """Whether steps close at their quota (elastic with ``max_staleness`` > 0)."""
    return sched.mode == "elastic" and sched.max_staleness > 0


def to_stop(first_versions: Mapping[K, int], trained_from: int, k: int) -> list[K]:
    """The running executions to stop when a step trained from ``trained_from`` meets its quota:
    those that would otherwise be trained more than ``k`` versions after their first call."""
    return [e for e, v in first_versions.items() if trained_from - v >= k]


def lookahead(step: int, last_step: int, barrier: bool, prompts: int, share: float) -> int:
    """How many of step ``step + 1``'s prompts step ``step`` dispatches with its own."""
    if barrier or step >= last_step:
        return 0
    return min(prompts, math.ceil(share * prompts))


def closes(complete: int, quota: int, running: int, stale_running: int, barrier: bool) -> bool:
    """Whether the step's queue is complete: its quota of groups is in and no stopped execution is
    still on its way; a barrier step (or one that can get no more groups) once nothing runs."""
    if barrier or running == 0:
        return running == 0
    return complete >= quota and stale_running == 0
