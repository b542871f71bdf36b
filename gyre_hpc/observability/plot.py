"""The run's reward and pass-rate curves, drawn from its events only (the run directory's
``metrics.png``)."""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.observability import events as ev


def plot_run(events: list[ev.Event], out: Path, title: str) -> Path | None:
    """Write the plot to ``out``; None when no step has finished yet."""
    steps = [e for e in events if isinstance(e, ev.Step)]
    if not steps:
        return None
    evals = [e for e in events if isinstance(e, ev.Eval)]
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on compute nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = [e.step for e in steps]
    ax.plot(x, [e.reward_mean for e in steps], "o-", label="training reward (mean)")
    ax.plot(x, [e.pass_rate for e in steps], "s--", label="training pass rate")
    if evals:
        ax.plot([e.step for e in evals], [e.pass_rate for e in evals], "D-", label="held-out pass rate")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out
