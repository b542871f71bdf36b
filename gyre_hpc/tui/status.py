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
_SKIP_DETAIL = {"t", "event", "roles", "switches", "claims", "staleness", "checkpoint", "layout"}
# Shown in their own tables, or too many to list.
_CHATTY = {
    "dispatched",
    "started",
    "finished",
    "switch_role",
    "role_switched",
    "weights_loaded",
    "switch",
    "step",
}
_ROLE_MARK = {"sampling": "S", "training": "T", "draining": "D", "idle": "."}
TIMELINE = 24


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
    counters: dict[str, int] = field(default_factory=lambda: {"d": 0, "p": 0, "f": 0})
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    queue: int = 0

    @classmethod
    def fold(cls, name: str, steps_total: int, events: list[dict[str, Any]], keep: int = 12) -> RunView:
        view = cls(name, steps_total)
        for e in events:
            view._apply(e)
        view.recent = [e for e in events if e.get("event") not in _CHATTY][-keep:]
        return view

    @property
    def last_micro_steps(self) -> int:
        return self.queue or (int(self.steps[-1].get("micro_steps", 0)) if self.steps else 0)

    @property
    def water(self) -> int:
        return self.counters["d"] - self.counters["f"]

    @property
    def rollout_capacity(self) -> int:
        return sum(c["capacity"] for c in self.cells.values() if c["role"] == "sampling")

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
                "capacity": e.get("capacity", 0),
                "version": None,
                "timeline": "",
            }
        elif kind == "role_switched" and e["cell"] in self.cells:
            cell = self.cells[e["cell"]]
            cell.update(role=e["role"], switched=e["t"])
            cell["timeline"] = (cell["timeline"] + _ROLE_MARK.get(e["role"], "?"))[-TIMELINE:]
        elif kind in ("dispatched", "finished") and "d" in e:
            self.counters.update(d=e["d"], p=e["p"], f=e["f"])
        elif kind == "weights_loaded":
            for unit in e.get("units", []):
                if unit in self.cells:
                    self.cells[unit]["version"] = e["version"]
        elif kind == "burst_end":
            self.queue = e.get("micro_steps", 0)
        elif kind == "switch":
            self.switches.append(e)
        elif kind == "eval":
            self.evals.append(e)
        elif kind == "step":
            self.step = e["step"]
            self.steps.append(e)
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
    cap = view.rollout_capacity
    parts.append(
        Text.assemble(
            f"executions: d {view.counters['d']} · p {view.counters['p']} · f {view.counters['f']}",
            "  water level ",
            (f"{view.water}", "bold"),
            f" / rollout capacity {cap}  ",
            _bar(view.water, max(cap, view.water, 1)),
            f"  · micro-steps in the last step {view.last_micro_steps}",
        )
    )
    parts += [_cells_table(view), _steps_table(view)]
    if view.switches:
        parts.append(_switches_table(view.switches[-6:]))
    parts.append(_events_table(view.recent))
    return Group(*parts)


def _bar(value: int, total: int, width: int = 20) -> str:
    filled = round(width * min(value, total) / total)
    return "█" * filled + "░" * (width - filled)


def _steps_table(view: RunView) -> Table:
    table = Table(title="steps", title_justify="left", expand=False)
    for col in ("step", "v", "reward", "pass", "held-out", "seconds", "sampling s", "micro-steps", "claims"):
        table.add_column(col, justify="right")
    evals = {e["step"]: e["pass_rate"] for e in view.evals}
    for e in view.steps[-8:]:
        claims = " ".join(f"{c}:{n}" for c, n in (e.get("claims") or {}).items())
        table.add_row(
            str(e["step"]),
            str(e.get("version", "")),
            f"{e['reward_mean']:.3f}" if "reward_mean" in e else "",
            f"{e['pass_rate']:.3f}" if "pass_rate" in e else "",
            f"{evals[e['step']]:.3f}" if e["step"] in evals else "",
            f"{e.get('seconds', 0):.1f}",
            f"{e.get('sample_seconds', 0):.1f}",
            str(e.get("micro_steps", "")),
            claims,
        )
    return table


def _switches_table(switches: list[dict[str, Any]]) -> Table:
    table = Table(title="recent switches", title_justify="left", expand=False)
    for col in ("time", "step", "cell", "switch", "seconds", "why"):
        table.add_column(col)
    for e in switches:
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(e["t"])),
            str(e.get("step", "")),
            str(e["cell"]),
            e["kind"],
            f"{e['seconds']:.3f}",
            e.get("reason", ""),
        )
    return table


def _cells_table(view: RunView) -> Table:
    table = Table(title="cells", title_justify="left", expand=False)
    for col in ("cell", "rank", "host", "role", "since", "version", f"roles over time (last {TIMELINE})"):
        table.add_column(col)
    for cell, info in sorted(view.cells.items()):
        since = (
            f"{time.time() - info['switched']:.0f} s ago" if info["switched"] and view.ended is None else ""
        )
        label = f"{cell}" + (" (pool)" if info["standalone"] else " (core)" if cell == 0 else "")
        version = "" if info.get("version") is None else f"v{info['version']}"
        timeline = info.get("timeline", "")
        table.add_row(label, str(info["rank"]), info["host"], info["role"], since, version, timeline)
    return table


def _events_table(events: list[dict[str, Any]]) -> Table:
    table = Table(title="recent events", title_justify="left", expand=False)
    for col in ("time", "event", "details"):
        table.add_column(col, overflow="fold")
    for e in events:
        details = " ".join(f"{k}={v}" for k, v in e.items() if k not in _SKIP_DETAIL and k != "command")
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), e["event"], details)
    return table
