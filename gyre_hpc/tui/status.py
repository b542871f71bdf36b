"""One frame of ``gyre-hpc status``: built from the run directory's events and the job state.

It never talks to a live process, so it works from a login node, on a finished run, and on a
run directory copied elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gyre_hpc.launch.slurm import JobState
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CATEGORIES, cell_totals

_STATUS_STYLE = {
    "completed": "green",
    "failed": "bold red",
    "interrupted": "yellow",
    "preempted": "yellow",
    "requeued": "yellow",
    "restarting": "yellow",
    "running": "cyan",
}
_SKIP_DETAIL = {"roles", "switches", "claims", "staleness", "checkpoint", "layout", "command", "groups"}
# Shown in their own tables, or too many to list.
_CHATTY = (
    ev.Dispatched,
    ev.Finished,
    ev.SwitchRole,
    ev.RoleSwitched,
    ev.WeightsLoaded,
    ev.Switch,
    ev.Step,
)
_ROLE_MARK = {"sampling": "S", "training": "T", "idle": "."}
TIMELINE = 24


@dataclass
class CellView:
    rank: int
    host: str
    standalone: bool
    capacity: int
    role: str = "idle"
    switched: float | None = None
    version: int | None = None
    timeline: str = ""


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
    cells: dict[int, CellView] = field(default_factory=dict)
    recent: list[ev.Event] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {"d": 0, "p": 0, "f": 0})
    steps: list[ev.Step] = field(default_factory=list)
    evals: list[ev.Eval] = field(default_factory=list)
    switches: list[ev.Switch] = field(default_factory=list)
    queue: int = 0
    attempts: int = 0
    """Worlds started: 1, then one more per restart, requeue or resume."""
    engines: dict[str, int] = field(default_factory=dict)
    """Each engine replica's URL → its cell."""
    engine_calls: dict[str, int] = field(default_factory=dict)
    """Model calls each engine served, over every step."""
    last_load: ev.WeightsLoaded | None = None
    engine_restarts: list[ev.EngineRestart] = field(default_factory=list)

    @classmethod
    def fold(cls, name: str, steps_total: int, events: list[ev.Event], keep: int = 12) -> RunView:
        view = cls(name, steps_total)
        for e in events:
            view._apply(e)
        view.recent = [e for e in events if not isinstance(e, _CHATTY)][-keep:]
        return view

    @property
    def last_micro_steps(self) -> int:
        return self.queue or (self.steps[-1].micro_steps if self.steps else 0)

    @property
    def water(self) -> int:
        return self.counters["d"] - self.counters["f"]

    @property
    def rollout_capacity(self) -> int:
        return sum(c.capacity for c in self.cells.values() if c.role == "sampling")

    def _apply(self, e: ev.Event) -> None:
        match e:
            case ev.RunStart():
                self.started, self.status = e.t, "running"
            case ev.WorldUp():
                self.attempts += 1
                self.status, self.reason, self.ended = "running", "", None
            case ev.Restarting():
                self.status, self.reason = "restarting", e.reason
            case ev.Hello():
                self.cells[e.cell] = CellView(e.rank, e.host, e.standalone, e.capacity)
                self.engines.update(dict.fromkeys(e.addresses, e.cell))
            case ev.RoleSwitched() if e.cell in self.cells:
                cell = self.cells[e.cell]
                cell.role, cell.switched = e.role, e.t
                cell.timeline = (cell.timeline + _ROLE_MARK.get(e.role, "?"))[-TIMELINE:]
            case ev.Dispatched() | ev.Finished():
                self.counters.update(d=e.d, p=e.p, f=e.f)
            case ev.WeightsLoaded():
                self.last_load = e
                for unit in e.units:
                    if unit in self.cells:
                        self.cells[unit].version = e.version
            case ev.EngineRestart():
                self.engine_restarts.append(e)
            case ev.BurstEnd():
                self.queue = e.micro_steps
            case ev.Switch():
                self.switches.append(e)
            case ev.Eval():
                self.evals.append(e)
            case ev.Step():
                self.step = e.step
                self.steps.append(e)
                for url, n in e.engine_calls.items():
                    self.engine_calls[url] = self.engine_calls.get(url, 0) + n
            case ev.RunEnd():
                self.status, self.reason, self.ended = e.status, e.reason, e.t

    @property
    def elapsed(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started


def render(view: RunView, job: JobState | None, run_path: str) -> RenderableType:
    head = Text.assemble(("gyre-hpc ", "bold"), (view.name, "bold cyan"), f"  {run_path}")
    shown = requeued(view, job)
    status = Text.assemble(
        "run: ",
        (shown, _STATUS_STYLE.get(shown, "")),
        f" · attempt {view.attempts}" if view.attempts > 1 or shown == "requeued" else "",
        f" · step {view.step}/{view.steps_total}",
        f" · {view.elapsed:.1f} s" if view.elapsed is not None else "",
    )
    parts: list[RenderableType] = [head, status]
    if view.reason:
        parts.append(Text(f"reason: {view.reason}", style="red"))
    if view.engine_restarts:
        r = view.engine_restarts[-1]
        line = (f"engine restarts: {len(view.engine_restarts)} (last: cell {r.cell}, {r.cause}, "
                f"{r.attempts} start(s), {r.seconds:.1f} s, back at version {r.version})")  # fmt: skip
        parts.append(Text(line, style="yellow"))
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
    if view.last_load is not None:
        parts.append(Text(_load_line(view.last_load)))
    parts += [_cells_table(view), _engines_table(view), _steps_table(view), _diagnostics_table(view)]
    if any(e.cell_seconds for e in view.steps):
        parts.append(_cell_time_table(view))
    if view.switches:
        parts.append(_switches_table(view.switches[-6:]))
    parts.append(_events_table(view.recent))
    return Group(*parts)


QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", "RUNNING")


def requeued(view: RunView, job: JobState | None) -> str:
    """The run's status, saying ``requeued`` for a preempted run whose job waits to start again."""
    if view.status == "preempted" and job is not None and job.state in QUEUED:
        return "requeued"
    return view.status


def _bar(value: int, total: int, width: int = 20) -> str:
    filled = round(width * min(value, total) / total)
    return "█" * filled + "░" * (width - filled)


def _steps_table(view: RunView) -> Table:
    table = Table(title="steps", title_justify="left", expand=False)
    columns = ("step", "v", "reward", "pass", "held-out", "seconds", "sampling s", "micro-steps", "claims",
               "stale tokens", "prefix reused")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    evals = {e.step: e.pass_rate for e in view.evals}
    for e in view.steps[-8:]:
        table.add_row(
            str(e.step),
            str(e.version),
            f"{e.reward_mean:.3f}",
            f"{e.pass_rate:.3f}",
            f"{evals[e.step]:.3f}" if e.step in evals else "",
            f"{e.seconds:.1f}",
            f"{e.sample_seconds:.1f}",
            str(e.micro_steps),
            " ".join(f"{c}:{n}" for c, n in e.claims.items()),
            staleness_shares(e.staleness_tokens),
            f"{e.cached_tokens / e.input_tokens:.0%}" if e.input_tokens else "",
        )
    return table


def _diagnostics_table(view: RunView) -> Table:
    """The rollout and the update, step by step: what RL engineers check first."""
    table = Table(title="diagnostics", title_justify="left", expand=False)
    columns = ("step", "calls/exec p50·max", "tokens/exec", "cut", "no-signal groups", "tool errors", "clip",
               "KL", "entropy", "mismatch mean·max", "sampled tok/s", "trained tok/s", "weights")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for e in view.steps[-8:]:
        calls, tokens, ts = e.calls_per_execution, e.tokens_per_execution, e.token_stats
        mismatch = ""
        if ts.get("mismatch_mean") is not None:
            mismatch = f"{ts['mismatch_mean']:.2g}·{ts['mismatch_max']:.2g}"
        table.add_row(
            str(e.step),
            f"{calls['p50']:g}·{calls['max']:g}" if calls else "",
            f"{tokens['mean']:.0f}" if tokens else "",
            _share(e.cut_share),
            f"{e.no_signal_groups}/{e.group_count}" if e.group_count else "",
            str(e.tool_errors),
            _share(ts.get("clip_fraction")),
            _num(ts.get("approx_kl")),
            _num(ts.get("entropy")),
            mismatch,
            f"{e.sampled_tokens / e.seconds:.0f}" if e.seconds else "",
            f"{e.forwarded_tokens / e.train_seconds:.0f}" if e.train_seconds else "",
            f"{e.weight_bytes / 1e6:.1f} MB {e.weight_seconds:.2f} s" if e.weight_bytes else "",
        )
    return table


def _cell_time_table(view: RunView) -> Table:
    """Where each cell's time went over the run (``cell_time``): shares and hours."""
    table = Table(title="where the cell time went", title_justify="left", expand=False)
    for col in ("cell", *CATEGORIES, "seconds"):
        table.add_column(col, justify="right")
    cells = sorted({c for e in view.steps for c in e.cell_seconds}, key=int)
    per_cell = {c: cell_totals([e.cell_seconds.get(c, {}) for e in view.steps]) for c in cells}
    for name, split in (*per_cell.items(), ("all", cell_totals(per_cell.values()))):
        total = sum(split.values())
        shares = [f"{split[what] / total:.0%}" if total else "" for what in CATEGORIES]
        table.add_row(name, *shares, f"{total:.1f}")
    return table


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def staleness_shares(histogram: dict[str, int]) -> str:
    """``0 96% · 1 4%``: the share of trained tokens at each version lag."""
    total = sum(histogram.values())
    return " · ".join(f"{lag} {n / total:.0%}" for lag, n in histogram.items()) if total else ""


def _switches_table(switches: list[ev.Switch]) -> Table:
    table = Table(title="recent switches", title_justify="left", expand=False)
    for col in ("time", "step", "cell", "switch", "seconds", "why"):
        table.add_column(col)
    for e in switches:
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.t)),
            str(e.step),
            str(e.cell),
            e.direction,
            f"{e.seconds:.3f}",
            e.reason,
        )
    return table


def _cells_table(view: RunView) -> Table:
    table = Table(title="cells", title_justify="left", expand=False)
    for col in ("cell", "rank", "host", "role", "since", "version", f"roles over time (last {TIMELINE})"):
        table.add_column(col)
    for cell, info in sorted(view.cells.items()):
        since = f"{time.time() - info.switched:.0f} s ago" if info.switched and view.ended is None else ""
        label = f"{cell}" + (" (pool)" if info.standalone else " (core)" if cell == 0 else "")
        version = "" if info.version is None else f"v{info.version}"
        table.add_row(label, str(info.rank), info.host, info.role, since, version, info.timeline)
    return table


def _load_line(e: ev.WeightsLoaded) -> str:
    """``last load: v3 into cells 0 1 · 1.2 MB sent of 3.6 MB whole · 4.1% changed · 0.05 s``."""
    sent = f" · {e.bytes / 1e6:.1f} MB sent of {e.whole_bytes / 1e6:.1f} MB whole" if e.whole_bytes else ""
    changed = "" if e.changed is None else f" · {e.changed:.1%} changed"
    cells = " ".join(map(str, e.units))
    return f"last load: v{e.version} into cells {cells}{sent}{changed} · {e.seconds:.2f} s"


def _engines_table(view: RunView) -> Table:
    """Calls each engine replica served: in the last step, and over the run."""
    table = Table(title="engines", title_justify="left", expand=False)
    for col, justify in (("engine", "left"), ("cell", "right"), ("calls last step", "right"),
                         ("calls", "right")):  # fmt: skip
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    last = view.steps[-1].engine_calls if view.steps else {}
    for url, cell in sorted(view.engines.items(), key=lambda kv: (kv[1], kv[0])):
        table.add_row(url, str(cell), str(last.get(url, 0)), str(view.engine_calls.get(url, 0)))
    return table


def _events_table(events: list[ev.Event]) -> Table:
    table = Table(title="recent events", title_justify="left", expand=False)
    for col in ("time", "event", "details"):
        table.add_column(col, overflow="fold")
    for e in events:
        details = " ".join(f"{k}={v}" for k, v in e.fields().items() if k not in _SKIP_DETAIL)
        table.add_row(time.strftime("%H:%M:%S", time.localtime(e.t)), ev.kind_of(e), details)
    return table
