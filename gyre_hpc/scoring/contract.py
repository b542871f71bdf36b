"""What a scorer is given and what it may answer.

A scorer looks only at what a run left behind (its workspace) and the task; never at its
length, its transcript or whether it finished. It returns a reward in [0, 1], or raises
``EvaluationError`` when the *evaluation* failed (retried; not a legitimate 0), or
``NoArtifact`` when there is nothing to evaluate at all (an infrastructure failure), or
``WorkspaceFault`` when what the workspace did made the evaluation fail (its code crashed the
test runner, hung past the time limit, changed the runner's results): that is a score, 0, and
never a drop — the policy must not be able to turn a 0 into "not trained on".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from gyre_hpc.sandbox.confine import UNCONFINED, Sandbox

Status = Literal["finished", "timed_out", "crashed"]


@dataclass(frozen=True)
class RunArtifacts:
    run_id: str
    workspace: Path
    status: Status
    task: Mapping[str, Any] = field(default_factory=dict)
    sandbox: Sandbox = UNCONFINED
    """Where the workspace's code runs when a scorer runs it (tests import it, commands execute
    it): the run's sandbox, over the scorer's copy, so that scoring does not hand the policy's code
    the run either."""
    reply: str = ""
    """The run's last word: its one reply to a question (a task with ``answers``), else the
    summary it finished with."""


class EvaluationError(Exception):
    """The evaluation could not be carried out (a broken harness, not a bad answer)."""


class NoArtifact(Exception):
    """The run left nothing to evaluate."""


class WorkspaceFault(Exception):
    """The evaluation failed because of what the workspace holds: a score of 0, with the reason."""


class Scorer(Protocol):
    def score(self, artifacts: RunArtifacts) -> float: ...
