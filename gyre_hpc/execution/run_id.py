"""Run ids: the one name of an execution, and the step it was dispatched for.

``s0007-<task>-g3`` is the fourth execution of a task's group in step 7; ``eval0007-<task>`` the
held-out evaluation of a task after step 7 (``eval0000``: before training), ``<task>-g0`` one of
``gyre-hpc eval`` outside any run. Every run id is made here, and everything that files or groups
executions by step (the workspaces, the journal, batching, the replay) reads it here; this module
knows nothing else.
"""

from __future__ import annotations

import re


def run_id(step: int, task_id: str, g: int) -> str:
    """The run of the ``g``-th execution of a task's group in ``step``."""
    return f"s{step:04d}-{task_id}-g{g}"


def eval_run_id(task_id: str, step: int | None = None) -> str:
    """A held-out evaluation of ``task_id``: after ``step`` of a run, or on its own (None)."""
    return f"{task_id}-g0" if step is None else f"eval{step:04d}-{task_id}"


def dispatched_step(run: str) -> int:
    """The step a ``run_id`` was dispatched for (0 for a run named otherwise, e.g. an evaluation's)."""
    m = re.match(r"s(\d+)-", run)
    return int(m.group(1)) if m else 0
