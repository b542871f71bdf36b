"""The run's reward and pass-rate curves and how stale its trained tokens were, drawn from its
events only (the run directory's ``metrics.png``)."""

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

    fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=100, height_ratios=(3, 1), sharex=True)
    x = [e.step for e in steps]
    ax.plot(x, [e.reward_mean for e in steps], "o-", label="training reward (mean)")
    ax.plot(x, [e.pass_rate for e in steps], "s--", label="training pass rate")
    if evals:
        ax.plot([e.step for e in evals], [e.pass_rate for e in evals], "D-", label="held-out pass rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    _staleness(low, steps)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def _staleness(ax, steps: list[ev.Step]) -> None:  # noqa: ANN001 - a matplotlib Axes
    """Each step's trained tokens as shares by version lag (0: on-policy), stacked."""
    lags = sorted({int(k) for e in steps for k in e.staleness_tokens})
    bottom = [0.0] * len(steps)
    for lag in lags:
        share = [
            e.staleness_tokens.get(str(lag), 0) / max(sum(e.staleness_tokens.values()), 1) for e in steps
        ]
        ax.bar([e.step for e in steps], share, bottom=bottom, label=f"{lag} behind")
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set(xlabel="step", ylabel="trained tokens\nby lag", ylim=(0, 1.02))
    if lags:
        ax.legend(loc="lower right", fontsize=7, ncol=len(lags))


def plot_runs(runs: dict[str, list[ev.Event]], out: Path, title: str) -> Path:
    """Several runs side by side (e.g. one knob's values on one seed): held-out pass rate, training
    reward, and the share of trained tokens that were off-policy, each against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, reward, stale) = plt.subplots(3, 1, figsize=(7, 8), dpi=100, sharex=True)
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
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
