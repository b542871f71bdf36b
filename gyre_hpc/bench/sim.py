"""``bench sim``: elastic, colocate and every async split (and ours) simulated on one workload,
with their time split, their ratios to the bounds and to each other, and plots.

Async is a family of baselines, one per fixed split: every split runs and elastic is compared
against the best one, never a chosen one.
"""

from __future__ import annotations

from pathlib import Path

from gyre_hpc.bench.report import Report, Table
from gyre_hpc.sim.config import (
    INFLIGHT_KS,
    OURS,
    PAPER_ABLATIONS,
    SimConfig,
    ablations,
    inflight_name,
    variants,
)
from gyre_hpc.sim.plots import plot_all
from gyre_hpc.sim.simulate import SimResult, simulate

SPLIT = ("sampling", "idle slots", "training", "idle", "switching")


def best_async(times: dict[str, float]) -> str | None:
    """The async variant with the shortest time (None when there is none)."""
    splits = [name for name in times if name.startswith("async")]
    return min(splits, key=times.__getitem__) if splits else None


def speedups(times: dict[str, float]) -> list[str]:
    """Elastic against the best async split and colocate, and ours against the paper's rule."""
    lines = []
    e, a = times.get("elastic"), best_async(times)
    if e and a:
        lines.append(f"elastic {times[a] / e:.2f}× vs the best async ({a}, of every split run)")
    if e and "colocate" in times:
        lines.append(f"elastic {times['colocate'] / e:.2f}× vs colocate")
    if e and OURS in times:
        lines.append(
            f"ours ({OURS}, scheduler.carry_tail) {e / times[OURS]:.3f}× vs the paper's elastic rule"
        )
    for k in INFLIGHT_KS:
        if e and (name := inflight_name(k)) in times:
            lines.append(f"ours ({name}, scheduler.max_staleness) {e / times[name]:.3f}× vs the paper's rule")
    return lines


def compare(name: str, cfg: SimConfig, out: Path, with_ablations: bool = False) -> Report:
    """Every variant of ``cfg`` simulated, tabulated and plotted into ``out``."""
    results = {variant: simulate(c, mode) for variant, (mode, c) in variants(cfg).items()}
    times = {variant: r.total_s for variant, r in results.items()}
    best = best_async(times)
    shape = f"{cfg.cells} cells × {cfg.capacity}, {cfg.prompts}×{cfg.group_size} executions"
    columns = (
        "mode",
        "total h",
        "mean step h",
        "total / bound",
        "total / on-policy bound",
        *SPLIT,
        "switches",
    )
    table = Table(title=f"{name}: {shape}, {cfg.steps} steps", columns=columns)
    for variant, r in results.items():
        share = r.time_split()
        table.rows.append(
            (
                variant + (" (best async)" if variant == best else ""),
                f"{r.total_s / 3600:.2f}",
                f"{r.total_s / 3600 / len(r.step_ends):.3f}",
                f"{r.total_s / r.bound_s:.3f}",
                "—" if r.step_bound_s is None else f"{r.total_s / r.step_bound_s:.3f}",
                *(f"{share[k]:.0%}" for k in SPLIT),
                str(r.switches),
            )
        )
    report: Report = [table, bound_note(results.get("elastic") or next(iter(results.values())), cfg)]
    report += speedups(times)
    if with_ablations:
        report.append(ablation_table(cfg, name))
    shown = {v: r for v, r in results.items() if not v.startswith("async") or v == best}
    report += [f"plot: {p}" for p in plot_all(shown, out, name)]
    return report


def bound_note(elastic: SimResult, cfg: SimConfig) -> str:
    return (
        f"bound {elastic.bound_s / 3600:.2f} h ({elastic.bound_s / 3600 / cfg.steps:.3f} h a step, elastic's "
        "work): the sampling each run was served and the training it did, spread over every slot and "
        "cell, and the last publication; each mode is over its own served work. On-policy bound "
        f"{(elastic.step_bound_s or 0.0) / 3600:.2f} h: steps in series, each its work or its longest "
        "execution and the training that must follow it, and its publication (colocate and elastic only)"
    )


def ablation_table(cfg: SimConfig, name: str) -> Table:
    table = Table(
        title=f"{name}: ablations",
        columns=("ablation", "baseline h", "variant h", "baseline / variant", "paper"),
    )
    for ablation, ((m0, c0), (m1, c1)) in ablations(cfg).items():
        t0, t1 = simulate(c0, m0).total_s, simulate(c1, m1).total_s
        table.rows.append(
            (ablation, f"{t0 / 3600:.1f}", f"{t1 / 3600:.1f}", f"{t0 / t1:.3f}", PAPER_ABLATIONS[ablation])
        )
    return table
