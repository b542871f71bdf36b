"""Experiment tracking: the run's step and evaluation records as named scalars, written to
TensorBoard (by default) and Weights & Biases (when the recipe asks).

```
 events ─▶ Step / Eval ─▶ scalars() ─┬─▶ TensorBoard   <run_dir>/tensorboard/events.out.tfevents.*
  (the typed records the TUI         └─▶ W&B           <run_dir>/wandb/ (offline) or the W&B server
   and the plot read)
```

``scalars`` is the one reducer: a record becomes ``{"group/name": value}``, and every writer
writes exactly that, at the record's step. A writer that fails is dropped with one warning: a
tracker never stops training. The writers know nothing of the run beyond the scalars and where
to write; W&B is imported only when asked for (``pip install gyre-hpc[wandb]``).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

from gyre_hpc.diskspace import describe
from gyre_hpc.errors import GyreError
from gyre_hpc.observability import events as ev

log = logging.getLogger(__name__)


def scalars(record: ev.Event) -> dict[str, float]:
    """A step or evaluation record's numbers by tracker name; {} for any other record."""
    if isinstance(record, ev.Eval):
        return {"eval/pass_rate": record.pass_rate, "eval/mean_score": record.mean_score}
    if not isinstance(record, ev.Step):
        return {}
    e = record
    out: dict[str, float | None] = {
        "rollout/reward_mean": e.reward_mean,
        "rollout/pass_rate": e.pass_rate,
        "rollout/executions": e.executions,
        "rollout/dropped": e.dropped,
        "rollout/calls": e.calls,
        "rollout/tool_calls": e.tool_calls,
        "rollout/tool_errors": e.tool_errors,
        "rollout/cut_share": e.cut_share,
        "rollout/no_signal_groups": e.no_signal_share,
        "train/loss": e.loss,
        "train/grad_norm": e.grad_norm,
        "train/tokens": e.tokens,
        "train/forwarded_tokens": e.forwarded_tokens,
        "train/off_policy_share": off_policy_share(e.staleness_tokens),
        "perf/step_s": e.seconds,
        "perf/sample_s": e.sample_seconds,
        "perf/train_s": e.train_seconds,
        "perf/apply_s": e.apply_seconds,
        "perf/sampled_tokens_per_s": e.sampled_tokens / e.seconds if e.seconds else None,
        "perf/trained_tokens_per_s": e.forwarded_tokens / e.train_seconds if e.train_seconds else None,
        "perf/switch_s": sum(float(s.get("seconds", 0.0)) for s in e.switches),
        "perf/weight_bytes": e.weight_bytes,
        "perf/weight_s": e.weight_seconds,
        "perf/controller_cpu_s": e.controller_cpu_s,
    }
    for status, n in e.statuses.items():
        out[f"rollout/status/{status}"] = n
    for what, stats in (("calls", e.calls_per_execution), ("tokens", e.tokens_per_execution)):
        for k, v in stats.items():
            out[f"rollout/{what}_per_execution/{k}"] = v
    for k, v in e.token_stats.items():
        out[f"train/{k}"] = v
    for cell, split in e.cell_seconds.items():
        for what, seconds in split.items():
            out[f"cells/{cell}/{what.replace(' ', '_')}_s"] = seconds
    return {k: float(v) for k, v in out.items() if v is not None}


def off_policy_share(histogram: dict[str, int]) -> float | None:
    """The share of trained tokens generated one version or more before the update's."""
    total = sum(histogram.values())
    return 1 - histogram.get("0", 0) / total if total else None


class Writer(Protocol):
    directory: Path
    """Where it writes (named when a write there fails)."""

    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """Event files under ``directory`` (TensorBoard reads the directory)."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self.writer = SummaryWriter(str(directory), flush_secs=30)

    def write(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # one write per step: a reader sees each step as it lands

    def close(self) -> None:
        self.writer.close()


class WandB:
    """One W&B run; ``mode`` offline writes it under ``directory`` (``wandb sync`` uploads it)."""

    def __init__(self, project: str, mode: str, directory: Path, name: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise GyreError(
                "observability.wandb_project is set but wandb is not installed: "
                "pip install 'gyre-hpc[wandb]', or set observability.wandb_project = \"\""
            ) from None
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(
            project=project, mode=mode, dir=str(directory), name=name, config=config, settings=settings
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every writer the recipe asked for; records go to each, a failing writer is dropped."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers

    def record(self, record: ev.Event) -> None:
        values = scalars(record)
        if not values:
            return
        step = record.step  # type: ignore[attr-defined] - Step and Eval both have it
        for w in list(self.writers):
            try:
                w.write(step, values)
            except Exception as err:  # a tracker must never stop training (a full disk names itself)
                why = describe(err, getattr(w, "directory", Path.cwd()))
                log.warning("tracker %s failed, dropped: %s", type(w).__name__, why)
                self.writers.remove(w)
                with contextlib.suppress(Exception):  # its own threads stop now, not later
                    w.close()

    def close(self) -> None:
        for w in self.writers:
            try:
                w.close()
            except Exception as err:
                log.warning("closing tracker %s: %s", type(w).__name__, err)
