"""A task's reference solution, applied to a workspace as an agent would: in the sandbox.

A Harbor task's ``solution/solve.sh`` runs with the workspace at the task's workdir and the
solution directory at ``/solution`` (read-only); a SWE instance's ``patch`` is applied with
``git apply`` in its workspace. What a reference earns is the check that a task's scoring can
reach 1.0 (``gyre-hpc tasks verify``); it never runs during training.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from gyre_hpc.agents.workspace import Workspace
from gyre_hpc.sandbox.confine import Sandbox
from gyre_hpc.sandbox.spec import Mount
from gyre_hpc.tasks.task import Task

SOLUTION = Path("/solution")


def has_reference(task: Task) -> bool:
    return bool(task.harbor.get("solution") or task.swe.get("patch"))


def apply(task: Task, workspace: Path, sandbox: Sandbox, timeout_s: float) -> str | None:
    """Run the task's reference solution in ``workspace``; what went wrong, or None."""
    with tempfile.TemporaryDirectory(prefix="gyre-reference-") as tmp:
        shown = Path(tmp)
        shown.chmod(0o755)  # the sandbox's uid reads it
        if task.harbor.get("solution"):
            solution = shown / "solution"
            shutil.copytree(task.harbor["solution"], solution, symlinks=False)
            box = sandbox.for_task(task).at(None, (Mount(solution, SOLUTION),))
            line = f"bash {SOLUTION}/solve.sh"
        elif task.swe.get("patch"):
            patch = shown / "reference.patch"
            patch.write_text(task.swe["patch"])
            patch.chmod(0o644)
            box = sandbox.showing([shown]).for_task(task)
            line = f"git apply --whitespace=nowarn {patch}"
        else:
            return "the task has no reference solution"
        result = Workspace(workspace, box).run(line, timeout_s)
    if result.timed_out or result.exit_code:
        tail = result.output.strip().splitlines()[-1:] or [""]
        return (
            f"`{line}` {'timed out' if result.timed_out else f'exited {result.exit_code}'}: {tail[0][:200]}"
        )
    return None
