"""What the controller hands an executor node, and the file that tells executors where it is.

A ``Job`` is one execution placed on a node: its run id, its task (every field, so a task
read from Harbor or SWE-bench data runs as it would on the controller), where its workspace
and journal live on the run directory (shared storage: a node that takes over an execution
finds its journal and workspace there), whether it was stopped before it started, and which
placement of it this is.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_hpc.proxy.keys import write_private_json
from gyre_hpc.tasks.task import Task


@dataclass(frozen=True)
class Job:
    run_id: str
    task: Task
    workspaces: Path
    journal: Path | None
    stopped: bool = False
    attempt: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "task": dataclasses.asdict(self.task),
            "workspaces": str(self.workspaces),
            "journal": None if self.journal is None else str(self.journal),
            "stopped": self.stopped,
            "attempt": self.attempt,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        journal = data["journal"]
        return cls(
            data["run"],
            Task(**data["task"]),
            Path(data["workspaces"]),
            None if journal is None else Path(journal),
            bool(data["stopped"]),
            int(data["attempt"]),
        )


@dataclass(frozen=True)
class HubAddress:
    """``executors/hub.json`` in the run directory (mode 600): where the controller's hub and
    proxy listen, and the token executors present. Written anew by every world, so an executor
    that outlives a controller finds the next one here."""

    url: str
    token: str
    proxy_url: str
    model: str
    hub_id: str
    proxy_workers: list[str] = dataclasses.field(default_factory=list)
    """With ``proxy.workers`` > 1: each worker's URL, by index (a run goes to its own)."""

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(24)

    def write(self, path: Path) -> None:
        write_private_json(path, dataclasses.asdict(self))

    @classmethod
    def read(cls, path: Path) -> HubAddress | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
