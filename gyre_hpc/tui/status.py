"""One frame of ``gyre-hpc status``: built from the run directory's events and the job state.

It never talks to a live process, so it works from a login node, on a finished run, and on a
run directory copied elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gyre_hpc.launch.slurm import JobState

_STATUS_STYLE = {"completed": "green", "failed": "bold red", "interrupted": "yellow", "running": "cyan"}
_SKIP_DETAIL = {"t", "event"}


@dataclass
class RunView:
    """What the events say about a run, folded once."""

    name: str
    steps_total: int
    status: str = "starting"
    reason: str = ""
    step: int = 0
    started: float | None = None
    ended: float | None = None
    cells: dict[int, dict[str, Any]] = field(default_factory=dict)
    recent: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def fold(cls, name: str, steps_total: int, events: list[dict[str, Any]], keep: int = 12) -> RunView:
        view = cls(name, steps_total)
        for e in events:
            view._apply(e)
        view.recent = events[-keep:]
        return view

    def _apply(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind == "run_start":
            self.started, self.status = e["t"], "running"
        elif kind == "hello":
            self.cells[e["cell"]] = {
                "rank": e["rank"],
                "host": e["host"],
                "role": "idle",
                "standalone": e.get("standalone", False),
                "switched": None,
            }
        elif kind == "role_switched" and e["cell"] in self.cells:
            self.cells[e["cell"]].update(role=e["role"], switched=e["t"])
        elif kind == "step":
            self.step = e["step"]
        elif kind == "run_end":
            self.status, self.reason, self.ended = e["status"], e.get("reason", ""), e["t"]

    @property
    def elapsed(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started


def render(view: RunView, job: JobState | None, run_path: str) -> RenderableType:
    head = Text.assemble(("gyre-hpc ", "bold"), (view.name, "bold cyan"), f"  {run_path}")
    status = Text.assemble(
        "run: ",
        (view.status, _STATUS_STYLE.get(view.status, "")),
        f" · step {view.step}/{view.steps_total}",
        f" · {view.elapsed:.1f} s" if view.elapsed is not None else "",
    )
    parts: list[RenderableType] = [head, status]
    if view.reason:
        parts.append(Text(f"reason: {view.reason}", style="red"))
    if job is not None:
        comps = ", ".join(f"{k} {v}" for k, v in job.components.items())
        parts.append(
            Text(
                f"slurm job {job.job_id}: {job.state}" + (f" ({comps})" if comps else "") + f" [{job.source}]"
            )
        )
    parts += [_cells_table(view), _events_table(view.recent)]
    return Group(*parts)


def _cells_table(view: RunView) -> Table:
    table = Table(title="cells", title_justify="left", expand=False)
    for col in ("cell", "rank", "host", "role", "since"):
        table.add_column(col)
    for cell, info in sorted(view.cells.items()):
        since = (
            f"{time.time() - info['switched']:.0f} s ago" if info["switched"] and view.ended is None else ""
        )
        label = f"{cell}" + (" (pool)" if info["standalone"] else " (core)" if cell == 0 else "")
        table.add_row(label, str(info["rank"]), info["host"], info["role"], since)
    return table


def _events_table(events: list[dict[str, Any]]) -> Table:
    table = Table(title="recent events", title_justify="left", expand=False)
    for col in ("time", "event", "details"):
        table.add_column(col, overflow="fold")
    for e in events:
        details = " ".join(f"{k}={v}" for k, v in e.items() if k not in _SKIP_DETAIL and k != "command")
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), e["event"], details)
    return table
