"""Events: the run's history, a typed public schema appended to ``<run_dir>/events.jsonl``.

```
 writers                                   events.jsonl                    readers
 launcher (run, sbatch epilogue) ─┐   {"t": …, "event": "step", …}   ┌─▶ status TUI, metrics plot
 controller (rank 0) ─────────────┼─▶ one JSON object per line ──────┼─▶ sim replay, bench
 a failing rank ──────────────────┘   (O_APPEND, one write each)     └─▶ outcome, run's progress
```

Every kind of record is one frozen dataclass below; writers emit instances and readers get
instances back (``read_events``), so a field is named once, here. On disk a record is its
fields plus ``t`` (seconds since the epoch) and ``event`` (its ``kind``). Each record is one
``os.write`` on an ``O_APPEND`` descriptor, so writers in several processes never interleave
inside a line; a reader drops a torn last line left by a writer that was killed mid-write, and
keeps a record of a kind it does not know as ``Other``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gyre_hpc.diskspace import write_all


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str] = ""
    t: float = 0.0
    """When it was written (seconds since the epoch); set by ``EventLog.emit``."""

    def fields(self) -> dict[str, Any]:
        """The record's own fields (without ``t``), as written."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "t"}


@dataclass(frozen=True, kw_only=True)
class RunStart(Event):
    kind: ClassVar[str] = "run_start"
    launcher: str
    """mpirun or slurm."""
    command: list[str] = field(default_factory=list)
    pid: int = 0
    job_id: str = ""


@dataclass(frozen=True, kw_only=True)
class WorldUp(Event):
    kind: ClassVar[str] = "world_up"
    size: int
    layout: str
    launcher: str
    job_id: str | None = None
    transport: str = ""
    attempt: int = 1
    """1 for the run's first world, then one more for each restart, requeue or resume."""


@dataclass(frozen=True, kw_only=True)
class ProxyUp(Event):
    kind: ClassVar[str] = "proxy_up"
    url: str


@dataclass(frozen=True, kw_only=True)
class SandboxUp(Event):
    """Where executions' commands run (``agent.sandbox`` as resolved on the controller's node)."""

    kind: ClassVar[str] = "sandbox"
    backend: str
    """bwrap, apptainer or none."""
    warning: str = ""
    """Why ``auto`` fell back to none (or, for the limits, to a weaker kind)."""
    limits: str = ""
    """How an execution's processes are limited together: cgroup-v1, cgroup-v2, uid or none."""


@dataclass(frozen=True, kw_only=True)
class Hello(Event):
    """A cell (or standalone rollout engine) is up and says where it serves: the URL of each of its
    engine replicas, in replica order. Its leader sends it (``runtime.protocol``); the controller
    records it as it came."""

    kind: ClassVar[str] = "hello"
    cell: int
    rank: int
    host: str
    pid: int
    addresses: tuple[str, ...]
    """Each engine replica's URL."""
    capacity: int
    standalone: bool = False


@dataclass(frozen=True, kw_only=True)
class EngineRestart(Event):
    """A cell's engine server died and was started again (``engine.restart_attempts``), or died
    while it first started and came up at a later attempt. Its leader sends it; the controller
    records it as it came."""

    kind: ClassVar[str] = "engine_restart"
    cell: int
    cause: str
    """What it was doing when it died: ``died during pause``, ``died (code -9)``, …"""
    attempts: int
    """Starts it took (1: the first came up)."""
    seconds: float
    version: int
    """The version it came back at: the newest its cell held."""


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    """A world that continues a run (runtime.resume.ResumePoint)."""

    kind: ClassVar[str] = "resumed"
    step: int
    """The first step this world runs."""
    version: int
    checkpoint: str = ""
    skipped: list[str] = field(default_factory=list)
    """Damaged newer checkpoints, each naming its file."""
    continued: int = 0
    kept_finished: int = 0
    dropped_records: int = 0


@dataclass(frozen=True, kw_only=True)
class SwitchRole(Event):
    """The controller told a cell to take a role."""

    kind: ClassVar[str] = "switch_role"
    cell: int
    role: str
    seq: int


@dataclass(frozen=True, kw_only=True)
class RoleSwitched(Event):
    """The cell has taken it."""

    kind: ClassVar[str] = "role_switched"
    cell: int
    role: str
    seq: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class WeightsLoaded(Event):
    kind: ClassVar[str] = "weights_loaded"
    version: int
    units: list[int]
    seconds: float
    bytes: int = 0
    """Sent into every replica of ``units``, together."""
    whole_bytes: int = 0
    """What the same version would have been whole, in each engine's served dtype."""
    changed: float | None = None
    """Of the elements, those whose bits changed since the version each engine held (delta
    only; null where the path does not look)."""


@dataclass(frozen=True, kw_only=True)
class Dispatched(Event):
    """An execution was handed to the harness; ``d``/``p``/``f`` are the run's counters after it."""

    kind: ClassVar[str] = "dispatched"
    run: str
    d: int
    p: int
    f: int


@dataclass(frozen=True, kw_only=True)
class Finished(Event):
    """An execution ended (done, failed or timed out) and was scored."""

    kind: ClassVar[str] = "finished"
    run: str
    d: int
    p: int
    f: int


@dataclass(frozen=True, kw_only=True)
class ExecutorUp(Event):
    """An executor node registered with the controller (``executors.hub``)."""

    kind: ClassVar[str] = "executor_up"
    node: str
    host: str
    pid: int
    slots: int


@dataclass(frozen=True, kw_only=True)
class Placed(Event):
    """An execution was handed to an executor node (``attempt`` 2 and up: placed again after
    the node it ran on was lost)."""

    kind: ClassVar[str] = "placed"
    run: str
    node: str
    attempt: int = 1


@dataclass(frozen=True, kw_only=True)
class ExecutorLost(Event):
    """An executor node was silent past ``executors.lease_s``: its executions are placed again."""

    kind: ClassVar[str] = "executor_lost"
    node: str
    runs: list[str]
    silent_s: float


@dataclass(frozen=True, kw_only=True)
class BurstEnd(Event):
    """The step's queue is complete: its last execution ended, or in-flight its quota of groups is
    in (``stop``: applied now, carry_tail)."""

    kind: ClassVar[str] = "burst_end"
    step: int
    micro_steps: int
    trainers: list[int]
    stop: bool = False


@dataclass(frozen=True, kw_only=True)
class StaleStopped(Event):
    """In-flight updates: executions stopped at the step's quota, since a later step would train
    them more than ``max_staleness`` versions behind; each is partially scored."""

    kind: ClassVar[str] = "stale_stopped"
    step: int
    runs: list[str]
    max_staleness: int


@dataclass(frozen=True, kw_only=True)
class Switch(Event):
    """A role switch the policy decided, carried out, with the time of each phase."""

    kind: ClassVar[str] = "switch"
    step: int
    cell: int
    direction: str
    """sampling→training or training→sampling."""
    reason: str
    seconds: float
    """All phases together."""
    drain_s: float = 0.0
    """Moving the cell's calls to the other engines (to training)."""
    switch_s: float = 0.0
    """The role switch itself, acknowledged by every rank of the cell."""
    load_s: float = 0.0
    """Loading the new version into its engine (to sampling)."""
    admit_s: float = 0.0
    """Admitting calls on it again (to sampling)."""
    w: int | None = None
    """The water level when it was decided (to training)."""


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    """One optimizer step, whatever the mode (built by ``scheduler.steps.step_event``)."""

    kind: ClassVar[str] = "step"
    step: int
    version: int
    """The version the step published (unchanged when it learned nothing)."""
    seconds: float
    sample_seconds: float
    """From the step's start to its burst's end."""
    roles: dict[str, str]
    """Each cell's role when the step closed."""
    executions: int = 0
    reward_mean: float = 0.0
    pass_rate: float = 0.0
    dropped: int = 0
    placeholders: int = 0
    """Executions scored as placeholders (nothing of theirs to score: the infrastructure failed,
    not the policy); ``trajectory.placeholders`` says whether their groups counted them."""
    trained_runs: int = 0
    sequences: int = 0
    micro_steps: int = 0
    tokens: int = 0
    """Tokens of the trained paths."""
    forwarded_tokens: int = 0
    """Tokens the trainers forwarded in the step, as each counts them: with tree packing fewer
    than ``tokens`` where a run's paths share prefixes, and fewer still where a micro-step is
    forwarded as one forest (the torch trainer; megatron under block masks), whose runs share
    their prompt; megatron on the CPU forwards one tree per run."""
    loss_tokens: int = 0
    calls: int = 0
    tool_calls: int = 0
    """Tool calls the step's executions carried out (built-in harness)."""
    tool_errors: int = 0
    """Of them, those that failed (an unknown tool, bad arguments, a command that could not run)."""
    calls_per_execution: dict[str, float] = field(default_factory=dict)
    """Model calls per execution: ``mean``, ``p50``, ``p90``, ``max``."""
    tokens_per_execution: dict[str, float] = field(default_factory=dict)
    """Tokens each execution's model calls generated (from its TITO tree), the same four."""
    sampled_tokens: int = 0
    """Tokens the step's executions generated, in all."""
    replies: int = 0
    cut_replies: int = 0
    """Model replies cut by ``max_tokens`` or the context (finish reason ``length``)."""
    no_signal_groups: int = 0
    """Prompt groups whose rewards are all equal: no advantage, nothing learned from them."""
    group_count: int = 0
    controller_cpu_s: float = 0.0
    """CPU seconds the controller's process spent in the step: its own threads (schedule, proxy,
    trajectories, and the harness when executions run there) and the processes it reaped
    (sandboxed commands and scorers run on its node)."""
    statuses: dict[str, int] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    """Each prompt group's work: ``task``, ``run_tokens`` (by sorted run id), ``sequence_tokens``
    (of each item binned into micro-steps: a path, or with tree packing a run's paths as a tree)."""
    engine_calls: dict[str, int] = field(default_factory=dict)
    """The step's trained runs' calls by the engine replica that served them (URL)."""
    input_tokens: int = 0
    """The input tokens of those calls; ``cached_tokens`` of them came from a prefix cache."""
    cached_tokens: int = 0
    staleness: dict[str, int] = field(default_factory=dict)
    """Calls by versions between the one trained from and the one that served them."""
    staleness_tokens: dict[str, int] = field(default_factory=dict)
    """Trained tokens by versions between the one the update trained from and the one that
    generated them (carried micro-steps included)."""
    loss: float = 0.0
    grad_norm: float = 0.0
    clipped_tokens: int = 0
    token_stats: dict[str, float | None] = field(default_factory=dict)
    """Over the trained tokens (``loss.diagnostics``): ``clip_fraction``, ``approx_kl`` to the
    behaviour policy, ``entropy`` (null where the trainer's logits are sharded), and the
    trainer/rollout log-prob mismatch on tokens trained at the version that sampled them:
    ``mismatch_mean``, ``mismatch_max``, ``mismatch_share`` (above 0.1), ``mismatch_tokens``,
    ``mask_fraction`` (loss tokens the mismatch correction rejected)."""
    claims: dict[str, int] = field(default_factory=dict)
    """Micro-steps each training cell claimed."""
    train_seconds: float = 0.0
    """The longest training cell's time in this step."""
    apply_seconds: float = 0.0
    checkpoint: str = ""
    skipped: bool = False
    """No gradient (every group had equal rewards): the version stays."""
    carried_in: int = 0
    carried_out: int = 0
    train_before_burst_end_s: float | None = None
    """How long training overlapped the burst (elastic)."""
    switches: list[dict[str, Any]] = field(default_factory=list)
    weight_bytes: int = 0
    weight_seconds: float = 0.0
    """Weight loads into engines since the previous step: bytes sent, seconds (slowest per load)."""
    cell_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each cell's time since ``cell_since`` by category (``cell_time.CATEGORIES``:
    sampling with busy slots, idle slots, training, idle, switching); they sum to the window."""
    cell_since: float = 0.0
    """When that window began (the previous step's record, or the first step's start)."""

    @property
    def cut_share(self) -> float | None:
        return self.cut_replies / self.replies if self.replies else None

    @property
    def no_signal_share(self) -> float | None:
        return self.no_signal_groups / self.group_count if self.group_count else None


@dataclass(frozen=True, kw_only=True)
class Eval(Event):
    kind: ClassVar[str] = "eval"
    step: int
    version: int
    n: int
    statuses: dict[str, int]
    pass_rate: float
    mean_score: float


@dataclass(frozen=True, kw_only=True)
class Shutdown(Event):
    kind: ClassVar[str] = "shutdown"
    reason: str


@dataclass(frozen=True, kw_only=True)
class Preempted(Event):
    """SIGUSR2 (Slurm's warning of the time limit): the run checkpointed this step and stops, to
    be requeued (Slurm) or resumed (``gyre-hpc run --resume``)."""

    kind: ClassVar[str] = "preempted"
    step: int
    checkpoint: str


@dataclass(frozen=True, kw_only=True)
class Restarting(Event):
    """The launcher restarts the world after a failure (``run.max_restarts``)."""

    kind: ClassVar[str] = "restarting"
    attempt: int
    """The attempt that starts now (2 for the first restart)."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class Interrupted(Event):
    kind: ClassVar[str] = "interrupted"
    rank: int
    signal: str


@dataclass(frozen=True, kw_only=True)
class RankFailed(Event):
    kind: ClassVar[str] = "rank_failed"
    rank: int
    task: int
    cell: int | None
    host: str
    error: str


@dataclass(frozen=True, kw_only=True)
class RunEnd(Event):
    kind: ClassVar[str] = "run_end"
    status: str
    """completed, failed, interrupted, or preempted (checkpointed on SIGUSR2; requeued under Slurm)."""
    reason: str = ""
    returncode: int = 0


@dataclass(frozen=True, kw_only=True)
class Other(Event):
    """A record of a kind this version does not know (kept, not dropped)."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return dict(self.data)


KINDS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStart,
        WorldUp,
        ProxyUp,
        SandboxUp,
        Hello,
        EngineRestart,
        Resumed,
        SwitchRole,
        RoleSwitched,
        WeightsLoaded,
        Dispatched,
        Finished,
        ExecutorUp,
        Placed,
        ExecutorLost,
        BurstEnd,
        StaleStopped,
        Switch,
        Step,
        Eval,
        Shutdown,
        Preempted,
        Restarting,
        Interrupted,
        RankFailed,
        RunEnd,
    )
}


def kind_of(event: Event) -> str:
    return event.name if isinstance(event, Other) else event.kind


def parse(record: dict[str, Any]) -> Event:
    """One record as read from disk; unknown keys are ignored, unknown kinds become ``Other``."""
    name = record.get("event", "")
    t = float(record.get("t", 0.0))
    cls = KINDS.get(name)
    data = {k: v for k, v in record.items() if k not in ("t", "event")}
    if cls is None:
        return Other(t=t, name=name, data=data)
    known = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(t=t, **{k: v for k, v in data.items() if k in known})
    except TypeError:  # a required field is missing: written by a version that lacked it
        return Other(t=t, name=name, data=data)


def open_log(path: str | Path) -> int:
    """An appending descriptor on a log of one JSON line per record. A last line torn by a writer
    that was killed mid-write (or hit a full disk) is ended first, so the next record starts a
    line of its own instead of being glued to the torn one and lost with it (readers skip the
    torn line)."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")
    return fd


class EventLog:
    """Appends events to one file; safe to share with other processes writing the same file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = open_log(self.path)

    def emit(self, event: Event) -> Event:
        """Write ``event`` now; returns it with its time."""
        event = dataclasses.replace(event, t=round(time.time(), 6))
        record = {"t": event.t, "event": kind_of(event), **event.fields()}
        write_all(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        return event

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | Path) -> list[Event]:
    """All complete records; a torn last line or a garbled line is skipped."""
    return EventTail(path).new()


class EventTail:
    """Follows an events file as it grows (the launcher's progress display)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def new(self) -> list[Event]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # leave a partly written last line for the next call
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(parse(record))
        return out
