"""Pictures of simulated runs: step times per mode, cell roles over time, GPU-time split (a
sampling cell's time divided into busy and idle slots)."""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.observability.cell_time import CATEGORIES
from gyre_hpc.observability.cell_time import COLORS as SPLIT
from gyre_hpc.observability.plot import save_figure
from gyre_hpc.sim.simulate import SimResult

COLORS = {what: SPLIT[what] for what in ("sampling", "training", "idle", "switching")}
"""A cell's states over time (the Gantt charts); the split adds a sampling cell's idle slots."""


def plot_all(results: dict[str, SimResult], out: Path, title: str, unit: str = "h") -> list[Path]:
    """Step times, a Gantt chart per mode and the time split; times in hours (``h``) or seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    scale = 3600.0 if unit == "h" else 1.0
    paths = []
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    for mode, r in results.items():
        ax.plot(range(1, len(r.step_times) + 1), [t / scale for t in r.step_times], "o-", label=mode)
    ax.set(xlabel="step", ylabel=f"step time ({unit})", title=f"{title}: step times")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(_save(fig, out / "step_times.png"))
    for mode, r in results.items():
        cells = len(r.cells)
        fig, ax = plt.subplots(figsize=(9, 0.4 * cells + 1.2), dpi=100)
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for cell, start, end, what in r.timeline:
            spans.setdefault((cell, what), []).append((start / scale, (end - start) / scale))
        for (cell, what), xs in spans.items():  # one call per cell and role: thousands of spans stay fast
            ax.broken_barh(xs, (cell - 0.4, 0.8), color=COLORS[what])
        ax.set(
            xlabel="hours" if unit == "h" else "seconds",
            ylabel="cell",
            title=f"{title}: {mode} — cell roles over time",
        )
        ax.set_ylim(cells - 0.5, -0.5)
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
        ax.legend(handles, list(COLORS), loc="upper right", ncol=4, fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out / f"gantt_{mode.replace('/', 'of').replace(' ', '-')}.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    bottom = [0.0] * len(results)
    splits = [r.time_split() for r in results.values()]
    for what in CATEGORIES:
        share = [split[what] for split in splits]
        ax.bar(list(results), share, bottom=bottom, color=SPLIT[what], label=what)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set(ylabel="share of cell time", title=f"{title}: GPU-time split")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out / "time_split.png"))
    return paths


def _save(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    return save_figure(fig, path, Path(__file__))
