"""The run's reward and pass-rate curves, drawn from ``events.jsonl`` only, into ``metrics.png``."""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.observability.events import read_events


def plot_run(run_dir: str | Path) -> Path | None:
    """Write ``<run_dir>/metrics.png``; None when no step has finished yet."""
    run_dir = Path(run_dir)
    events = read_events(run_dir / "events.jsonl")
    steps = [e for e in events if e["event"] == "step" and "reward_mean" in e]
    if not steps:
        return None
    evals = [e for e in events if e["event"] == "eval"]
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on compute nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = [e["step"] for e in steps]
    ax.plot(x, [e["reward_mean"] for e in steps], "o-", label="training reward (mean)")
    ax.plot(x, [e["pass_rate"] for e in steps], "s--", label="training pass rate")
    if evals:
        ax.plot([e["step"] for e in evals], [e["pass_rate"] for e in evals], "D-", label="held-out pass rate")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out = run_dir / "metrics.png"
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out
