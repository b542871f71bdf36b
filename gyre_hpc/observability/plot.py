"""Pictures of a run, drawn from its events only: the reward and pass-rate curves and how stale
its trained tokens were (``metrics.png``), and where each cell's time went (``cells.png``).

Each function returns the path it wrote; the series it draws are named in its legend, in the
colours of ``SERIES`` (metrics) and ``cell_time.COLORS`` (cells), so a reader of the
file can find each one.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CATEGORIES, COLORS, cell_totals

SERIES = {
    "training reward (mean)": "#1f77b4",
    "training pass rate": "#ff7f0e",
    "held-out pass rate": "#2ca02c",
}
LAGS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
"""Trained tokens by version lag, 0 first."""


def _pyplot():  # noqa: ANN202 - the matplotlib module, files only
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on compute nodes
    import matplotlib.pyplot as plt

    return plt


def _integer_steps(ax) -> None:  # noqa: ANN001 - a matplotlib Axes
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig, out: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    return save_figure(fig, out, Path(__file__))


SOURCE = "Source"
"""The PNG text key naming the code that drew a plot (``source_of``)."""


def source_of(module: Path) -> str:
    """``<module>@<digest>``: the drawing code as it is now, normalised (docstrings and layout left
    out), so a plot says which code drew it and a plot older than its code is found."""
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    digest = hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()[:16]
    return f"{module.name}@{digest}"


def save_figure(fig, out: Path, drawn_by: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    """Written whole or not at all (a reader never sees half a PNG), naming the code that drew it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, metadata={SOURCE: source_of(drawn_by)})
    _pyplot().close(fig)
    tmp.replace(out)
    return out


def plot_run(events: list[ev.Event], out: Path, title: str) -> Path | None:
    """Write the plot to ``out``; None when no step has finished yet."""
    steps = [e for e in events if isinstance(e, ev.Step)]
    if not steps:
        return None
    evals = [e for e in events if isinstance(e, ev.Eval)]
    fig, (ax, low) = _pyplot().subplots(2, 1, figsize=(7, 5.5), dpi=100, height_ratios=(3, 1), sharex=True)
    x = [e.step for e in steps]
    names = list(SERIES)
    ax.plot(x, [e.reward_mean for e in steps], "o-", color=SERIES[names[0]], label=names[0])
    ax.plot(x, [e.pass_rate for e in steps], "s--", color=SERIES[names[1]], label=names[1])
    if evals:  # from step 0, the policy before any update, when tasks.eval_every is set
        held = sorted({e.step: e.pass_rate for e in evals}.items())  # a resumed run's repeat once
        ax.plot(*zip(*held, strict=True), "D-", color=SERIES[names[2]], label=names[2])
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    _staleness(low, steps)
    _integer_steps(low)
    fig.tight_layout()
    return _save(fig, out)


def _staleness(ax, steps: list[ev.Step]) -> None:  # noqa: ANN001 - a matplotlib Axes
    """Each step's trained tokens as shares by version lag (0: on-policy), stacked."""
    lags = sorted({int(k) for e in steps for k in e.staleness_tokens})
    bottom = [0.0] * len(steps)
    for lag in lags:
        share = [
            e.staleness_tokens.get(str(lag), 0) / max(sum(e.staleness_tokens.values()), 1) for e in steps
        ]
        color = LAGS[min(lag, len(LAGS) - 1)]
        ax.bar([e.step for e in steps], share, bottom=bottom, color=color, label=f"{lag} behind")
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set(xlabel="step", ylabel="trained tokens\nby lag", ylim=(0, 1.02))
    if lags:
        ax.legend(loc="lower right", fontsize=7, ncol=len(lags))


def plot_cells(events: list[ev.Event], out: Path, title: str) -> Path | None:
    """Where each cell's time went (the step events' ``cell_seconds``): per cell and in total,
    and every cell together step by step; None before a step has recorded it."""
    steps = [e for e in events if isinstance(e, ev.Step) and e.cell_seconds]
    if not steps:
        return None
    cells = sorted({c for e in steps for c in e.cell_seconds}, key=int)
    per_cell = {c: cell_totals([e.cell_seconds.get(c, {}) for e in steps]) for c in cells}
    rows = {**{f"cell {c}": per_cell[c] for c in cells}, "all cells": cell_totals(per_cell.values())}
    fig, (left, right) = _pyplot().subplots(1, 2, figsize=(11, 0.35 * len(rows) + 3), dpi=100)
    left_edge = [0.0] * len(rows)
    for what in CATEGORIES:
        share = [r[what] / max(sum(r.values()), 1e-9) for r in rows.values()]
        left.barh(list(rows), share, left=left_edge, color=COLORS[what], label=what)
        left_edge = [a + b for a, b in zip(left_edge, share, strict=True)]
    left.invert_yaxis()
    left.set(xlabel="share of the cell's time", xlim=(0, 1), title=f"{title}: where the cell-hours went")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(CATEGORIES))
    x = [e.step for e in steps]
    bottom = [0.0] * len(steps)
    for what in CATEGORIES:
        seconds = [sum(split.get(what, 0.0) for split in e.cell_seconds.values()) for e in steps]
        right.bar(x, seconds, bottom=bottom, color=COLORS[what], label=what)
        bottom = [a + b for a, b in zip(bottom, seconds, strict=True)]
    right.set(xlabel="step", ylabel="cell-seconds (all cells)", title="per step")
    _integer_steps(right)
    fig.tight_layout()
    return _save(fig, out)


def plot_runs(runs: dict[str, list[ev.Event]], out: Path, title: str) -> Path:
    """Several runs side by side (e.g. one knob's values on one seed): held-out pass rate, training
    reward, and the share of trained tokens that were off-policy, each against the step."""
    fig, (held, reward, stale) = _pyplot().subplots(3, 1, figsize=(7, 8), dpi=100, sharex=True)
    for label, events in runs.items():
        steps = [e for e in events if isinstance(e, ev.Step)]
        evals = [e for e in events if isinstance(e, ev.Eval)]
        held.plot([e.step for e in evals], [e.pass_rate for e in evals], "D-", label=label)
        reward.plot([e.step for e in steps], [e.reward_mean for e in steps], ".-", label=label)
        off = [1 - e.staleness_tokens.get("0", 0) / max(sum(e.staleness_tokens.values()), 1) for e in steps]
        stale.plot([e.step for e in steps], off, ".-", label=label)
    held.set(ylabel="held-out pass rate", title=title)
    reward.set(ylabel="training reward")
    stale.set(xlabel="step", ylabel="trained tokens\n≥ 1 version behind", ylim=(-0.02, 1.02))
    for ax in (held, reward, stale):
        ax.grid(alpha=0.3)
    held.legend(loc="lower right", fontsize=8)
    _integer_steps(stale)
    fig.tight_layout()
    return _save(fig, out)
