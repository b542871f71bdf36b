"""Replay an emulated run in the simulator: the workload it recorded and the costs measured in it.

```
 run directory ─▶ recipe.toml: cells, capacity, batch, decode and training delays
               └▶ events.jsonl: each step's groups (tokens generated per run, sequence lengths)
                               ─▶ Workload: durations = tokens × decode_s, micro-steps packed
                  switch / step / dispatched / finished events ─▶ the runtime's measured costs
```

Only emulated runs (``engine.backend = "emulated"``) are replayable: there, an execution's
duration is its token count times a known delay, and a micro-step's its tokens times another.
The costs are medians over the run, so one run calibrates the simulator for every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from statistics import median

from gyre_hpc.errors import GyreError
from gyre_hpc.execution.run_id import run_id
from gyre_hpc.observability import events as ev
from gyre_hpc.observability.cell_time import CellTime
from gyre_hpc.recipe.schema import CellsConfig, Recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.sim.config import SimConfig
from gyre_hpc.sim.simulate import PromptGroup, SimResult, Workload, packed
from gyre_hpc.tasks.data_order import step_tasks


def run_tokens(steps: list[ev.Step]) -> dict[str, int]:
    """Run id → tokens it generated, from the step events' groups (listed by sorted run id)."""
    out = {}
    for s in steps:
        for g in s.groups:
            dispatched = g.get("step", s.step)
            runs = sorted(run_id(dispatched, g["task"], i) for i in range(len(g["run_tokens"])))
            out |= dict(zip(runs, g["run_tokens"], strict=True))
    return out


def workload(
    cfg: SimConfig, steps: list[ev.Step], decode_s: float, order: Callable[[int], list[str]] | None = None
) -> Workload:
    """Each step's groups, by the step they were dispatched for (in-flight updates train some
    in a later one), in the order of its prompts (``order``: a step's task ids; a look-ahead
    dispatches the first ones)."""
    by_step: dict[int, list[dict]] = {s.step: [] for s in steps}
    for s in steps:
        for g in s.groups:
            by_step.setdefault(g.get("step", s.step), []).append(g)
    if order is not None:
        for step, groups in by_step.items():
            rank = {task: i for i, task in enumerate(order(step))}
            groups.sort(key=lambda g: rank.get(g["task"], len(rank)))

    def groups(step: int) -> list[PromptGroup]:
        if step not in by_step:
            raise GyreError(f"the recorded run has no step {step}")
        return [
            PromptGroup(
                tuple(t * decode_s for t in g["run_tokens"]),
                packed(cfg, list(g["sequence_tokens"])),
                tuple(g["sequence_tokens"]),
            )
            for g in by_step[step]
        ]

    return groups


def measured_costs(events: list[ev.Event], cells: CellsConfig, decode_s: float) -> dict[str, float]:
    """The runtime's own costs: switches, version publication, and per-execution overhead.

    The overhead is what an execution took beyond its tokens' decode time, measured on the
    executions that never contended for a slot (`uncontended_dispatches`): one that queued spent
    that wait in the queue the simulator models itself, and counting it here would charge it
    twice. Where every execution queued (one sampling cell for a whole burst), the least
    overhead any of them showed stands in: an upper bound on its own overhead, and the only
    figure not made mostly of queueing."""
    steps = [e for e in events if isinstance(e, ev.Step)]
    tokens = run_tokens(steps)
    start = {e.run: e.t for e in events if isinstance(e, ev.Dispatched)}
    beyond = {
        e.run: e.t - start[e.run] - tokens[e.run] * decode_s
        for e in events
        if isinstance(e, ev.Finished) and e.run in tokens and e.run in start
    }
    clean = [beyond[run] for run in uncontended_dispatches(events, cells) if run in beyond]
    overhead = median(clean) if clean else min(beyond.values(), default=0.0)
    switches = [e for e in events if isinstance(e, ev.Switch)]
    to_train = [e.seconds for e in switches if e.direction == "sampling→training"]
    to_sample = [e.seconds for e in switches if e.direction == "training→sampling"]
    costs = {"exec_overhead_s": max(overhead, 0.0)}
    if to_train and to_sample:
        costs |= {"switch_to_train_s": median(to_train), "switch_to_sample_s": median(to_sample)}
    if steps:
        costs["publish_s"] = median(e.apply_seconds for e in steps)
    return costs


def uncontended_dispatches(events: list[ev.Event], cells: CellsConfig) -> dict[str, float]:
    """Run id → when it was dispatched, for the executions that never contended for a slot:
    from their dispatch to their end, the executions under way (``d − f``) never outnumbered
    the slots of the cells sampling and of the pool. Dispatch order says nothing of which
    queued execution an engine serves first (the calls reach it in whatever order their agents
    make them), so an execution dispatched while others queued may itself have waited. A cell
    stops counting when told to train, and counts again once it samples."""
    sampling = set(range(cells.count))
    open_: dict[str, float] = {}
    out = {}
    for e in events:
        if isinstance(e, ev.SwitchRole) and e.role != "sampling":
            sampling.discard(e.cell)
        elif isinstance(e, ev.RoleSwitched) and e.role == "sampling":
            sampling.add(e.cell)
        elif isinstance(e, ev.Dispatched):
            open_[e.run] = e.t
        elif isinstance(e, ev.Finished) and e.run in open_:
            out[e.run] = open_.pop(e.run)
        slots = (len(sampling) + cells.rollout_pool) * cells.capacity
        if isinstance(e, ev.Dispatched | ev.Finished) and e.d - e.f > slots:
            open_.clear()  # every execution under way may have waited for a slot
    return out


def replay(run_dir: Path, costs: dict[str, float] | None = None) -> tuple[SimConfig, Workload]:
    """The simulator's config and workload for a recorded emulated run. ``costs`` (e.g. measured
    in another mode's run) replace the ones measured in this run."""
    rd = RunDir(run_dir)
    if not rd.recipe_path.exists() or not rd.events.exists():
        raise GyreError(f"{run_dir} is not a run directory (no {rd.recipe_path.name} or {rd.events.name})")
    r = rd.read_recipe()
    if r.engine.backend != "emulated" or r.trainer.backend != "emulated":
        raise GyreError(
            f"{run_dir}: only emulated runs can be replayed (engine.backend and trainer.backend = "
            f"'emulated'); this one has {r.engine.backend!r} and {r.trainer.backend!r}"
        )
    events = rd.read_events()
    steps = [e for e in events if isinstance(e, ev.Step)]
    costs = costs or measured_costs(events, r.cells, r.engine.emulated_decode_s)
    cfg = config_of(r, len(steps)).with_(**costs)
    order = lambda step: [t.id for t in step_tasks(r.tasks, r.run.seed, step)]  # noqa: E731
    return cfg, workload(cfg, steps, r.engine.emulated_decode_s, order)


def config_of(r: Recipe, steps: int) -> SimConfig:
    return SimConfig(
        cells=r.cells.count,
        capacity=r.cells.capacity,
        pool_capacity=r.cells.rollout_pool * r.cells.capacity,
        prompts=r.tasks.prompts_per_step,
        group_size=r.tasks.group_size,
        steps=steps,
        timeout_s=r.engine.max_new_tokens * r.engine.emulated_decode_s,
        micro_step_tokens=r.trainer.micro_step_tokens,
        train_s_per_token=r.trainer.emulated_s_per_token,
        async_train_cells=r.scheduler.async_train_cells,
        min_queued=r.scheduler.min_queued_microsteps,
        carry_tail=r.scheduler.carry_tail,
        max_staleness=r.scheduler.max_staleness,
        lookahead=r.scheduler.lookahead,
        checkpoint_every=r.trainer.checkpoint_every,
        seed=r.run.seed,
    )


def observed(run_dir: Path) -> SimResult:
    """What a real run did, in the simulator's terms (step ends, switches, role timeline, time
    split), so both are tabulated, drawn and compared alike. Times are seconds from the first
    dispatch; a training cell waiting for micro-steps counts as training (the runtime does not
    record it apart)."""
    rd = RunDir(run_dir)
    events = rd.read_events()
    t0 = min(e.t for e in events if isinstance(e, ev.Dispatched))
    end = max(e.t for e in events if isinstance(e, ev.Step))
    roles = next(e for e in events if isinstance(e, ev.Step)).roles
    state = {int(c): "sampling" for c in roles}
    for e in events:  # roles taken before the first burst (async's fixed split)
        if isinstance(e, ev.SwitchRole) and e.t <= t0 and e.cell in state:
            state[e.cell] = e.role
    since = dict.fromkeys(state, 0.0)
    seconds = {c: dict.fromkeys(("sampling", "training", "idle", "switching"), 0.0) for c in state}
    timeline: list[tuple[int, float, float, str]] = []

    def close(cell: int, now: float, what: str) -> None:
        if now > since[cell]:
            timeline.append((cell, since[cell], now, state[cell]))
            seconds[cell][state[cell]] += now - since[cell]
        state[cell], since[cell] = what, now

    for e in events:
        now = min(e.t, end) - t0
        if now < 0 or not isinstance(e, ev.SwitchRole | ev.RoleSwitched) or e.cell not in state:
            continue
        close(e.cell, now, "switching" if isinstance(e, ev.SwitchRole) else e.role)
    for c in state:
        close(c, end - t0, state[c])
    steps = [e.t - t0 for e in events if isinstance(e, ev.Step)]
    log = [(e.step, e.cell, e.direction.split("→")[1]) for e in events if isinstance(e, ev.Switch)]
    mode = rd.read_recipe().scheduler.mode
    cells = [CellTime(**seconds[c]) for c in sorted(seconds)]  # no slot occupancy: all of sampling busy
    return SimResult(
        mode=mode, step_ends=steps, total_s=end - t0, cells=cells, switch_log=log, timeline=timeline
    )
