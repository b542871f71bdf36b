"""Run ids: the one name of an execution, and the step it was dispatched for.

``s0007-<task>-g3`` is the fourth execution of a task's group in step 7. Everything that files
or groups executions by step (the workspaces, the journal, batching, the replay) reads it here;
this module knows nothing else.
"""

from __future__ import annotations

import re


def run_id(step: int, task_id: str, g: int) -> str:
    """The run of the ``g``-th execution of a task's group in ``step``."""
    return f"s{step:04d}-{task_id}-g{g}"


def dispatched_step(run: str) -> int:
    """The step a ``run_id`` was dispatched for (0 for a run named otherwise, e.g. an evaluation's)."""
    m = re.match(r"s(\d+)-", run)
    return int(m.group(1)) if m else 0
