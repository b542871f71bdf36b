"""The elastic step: cells move to training one by one while the burst is still running.

```
 dispatch burst k (d = jobs) ──▶ every finished run: f += 1; its group complete?
        │                         └─▶ group → micro-steps appended to the open queue
        │                              (sent to the cells already training: MicroSteps)
        ▼
 poll loop ── decide(SchedState) ── next cell (core first) to TRAINING when w ≤ C_R − C_e:
        │       drain it in the proxy (its calls continue elsewhere, KV moved) → SwitchRole
        │       → TrainStep(snapshot v, queue so far) → it claims micro-steps as they come
        ├── f == d: CloseQueue(total) ── every trainer reports TrainDone ── ApplyStep → v+1
        │    carry_tail: CloseQueue(stop) instead; what nobody trained leads step k+1's queue
        ▼
 after the step: sampling engines load v+1; trainers return (last first), load v+1, admit
```

The decisions are ``scheduler.policy.decide`` (pure, shared with the simulator); this module
only carries them out through the controller's primitives.
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING, Any

from gyre_hpc.agents.dispatch import Outcome
from gyre_hpc.runtime.protocol import (
    POLL_INTERVAL_S,
    CloseQueue,
    Heartbeat,
    MicroSteps,
    ProtocolError,
    Role,
    StepApplied,
    TrainDone,
    TrainStep,
)
from gyre_hpc.runtime.step_data import StreamingBatch
from gyre_hpc.scheduler.policy import SchedState, Switch, carries_tail, decide
from gyre_hpc.trajectory.batch import TrainSequence

if TYPE_CHECKING:
    from gyre_hpc.runtime.controller import Controller


class ElasticStep:
    def __init__(self, ctl: Controller, step: int, carried: list[list[TrainSequence]]) -> None:
        self.ctl, self.step = ctl, step
        self.carried_in = len(carried)
        self.batch = StreamingBatch(
            ctl.tasks.group_size,
            ctl.trajectory,
            ctl.trainer_cfg.micro_step_tokens,
            ctl.run_cfg.seed,
            step,
            carried,
        )
        self.finished: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self.trainers: dict[int, float] = {}  # cell -> when it joined
        self.done: dict[int, TrainDone] = {}
        self.closed_at: float | None = None
        self.stopped = False
        self.switches: list[dict[str, Any]] = []

    def run(self) -> list[list[TrainSequence]]:
        """Carry out the step; the micro-steps left for the next one (``carry_tail``)."""
        ctl, started = self.ctl, time.monotonic()
        ctl.transport.reset_counter()  # nobody claims between steps
        future = ctl.dispatch(self.step, on_outcome=self.finished.put)
        self.d, self.f = self.expected(), 0
        while not self.trained():
            self.take_outcomes()
            if self.f == self.d and self.closed_at is None:
                self.close()
            if not self.stopped:
                for sw in decide(self.state(step_open=True)):
                    self.to_training(sw)
            self.poll()
        future.result()  # surfaces a dispatcher error
        tito_bytes = ctl.serving.tito_bytes()
        trained = {i for d in self.done.values() for i in d.claimed}
        left = [mb for i, mb in enumerate(self.batch.queue) if i not in trained]
        applied = self.apply(tito_bytes, trained)
        ctl.version = applied.version
        sampling = [u for u, r in ctl.roles.items() if r == Role.SAMPLING]
        ctl.load_weights(ctl.version, sampling)
        while sw := decide(self.state(step_open=False)):
            self.to_sampling(sw[0])
        info = {
            **self.batch.stats(),
            "loss": sum(d.loss_sum for d in self.done.values()) / max(self.batch.num_runs, 1),
            "grad_norm": round(applied.grad_norm, 6),
            "apply_seconds": round(applied.seconds, 3),
            "carried_in": self.carried_in,
            "carried_out": len(left),
            "claims": {str(c): len(d.claimed) for c, d in sorted(self.done.items())},
            "train_before_burst_end_s": round(self.closed_at - min(self.trainers.values()), 3)
            if self.trainers and self.closed_at
            else None,
            "switches": self.switches,
            "checkpoint": applied.checkpoint,
            "staleness": self.staleness(),
        }
        if self.batch.num_runs == 0 and not trained:
            info["skipped"] = True
        ctl.finish_step(self.step, started, self.closed_at or time.monotonic(), info)
        return left

    def staleness(self) -> dict[str, int]:
        """Versions between the one trained from and the one each call was served by."""
        trained_from = self.ctl.version - (0 if self.batch.num_runs == 0 else 1)
        count: dict[str, int] = {}
        for tree in self.batch.trees.values():
            for r in tree.records():
                key = str(trained_from - r.policy_version)
                count[key] = count.get(key, 0) + 1
        return dict(sorted(count.items()))

    def expected(self) -> int:
        return self.ctl.tasks.prompts_per_step * self.ctl.tasks.group_size

    def trained(self) -> bool:
        """The burst has ended and every cell that joined has trained out the queue (an empty
        queue needs no trainer; a non-empty one needs at least one)."""
        if self.closed_at is None or set(self.done) != set(self.trainers):
            return False
        return bool(self.trainers) or not self.batch.queue

    def take_outcomes(self) -> None:
        while True:
            try:
                outcome = self.finished.get_nowait()
            except queue.Empty:
                return
            self.f += 1
            run = outcome.execution.run_id
            new = self.batch.add(outcome, self.ctl.serving.trees([run]).get(run))
            if new:
                for cell in self.trainers:
                    self.ctl.channel.send(MicroSteps(self.step, new), self.ctl.world.layout.leader(cell))

    def close(self) -> None:
        ctl = self.ctl
        self.closed_at = time.monotonic()
        total = len(self.batch.queue)
        self.stopped = carries_tail(
            "elastic",
            ctl.scheduler.carry_tail,
            len(self.trainers),
            ends_run=self.step == ctl.run_cfg.steps,
            checkpoint=ctl.writes_checkpoint(self.step),
            stale_left=max(self.carried_in - ctl.transport.claimed(), 0),  # claims go in queue order
        )
        for cell in self.trainers:
            ctl.channel.send(CloseQueue(self.step, total, self.stopped), ctl.world.layout.leader(cell))
        ctl.events.emit(
            "burst_end", step=self.step, micro_steps=total, trainers=sorted(self.trainers), stop=self.stopped
        )

    def state(self, step_open: bool) -> SchedState:
        ctl = self.ctl
        cells = ctl.world.layout.cells
        pool = sum(ctl.hellos[u].capacity for u in range(cells, ctl.world.layout.units))
        queued = max(len(self.batch.queue) - ctl.transport.claimed(), 0) if step_open else 0
        return SchedState(
            mode="elastic",
            roles=tuple(ctl.roles[c] for c in range(cells)),
            capacity=tuple(ctl.hellos[c].capacity for c in range(cells)),
            pool_capacity=pool,
            dispatched=self.d,
            finished=self.f,
            queued=queued,
            step_open=step_open,
            min_queued=ctl.scheduler.min_queued_microsteps,
        )

    def to_training(self, sw: Switch) -> None:
        ctl = self.ctl
        t0 = time.monotonic()
        keep = {ctl.hellos[u].address for u, r in ctl.roles.items() if r == Role.SAMPLING and u != sw.cell}
        ctl.serving.set_sampling(keep)  # drain: its calls continue on the others
        t1 = time.monotonic()
        ctl.switch({sw.cell: Role.TRAINING})
        t2 = time.monotonic()
        closed = self.closed_at is not None
        ctl.channel.send(
            TrainStep(self.step, ctl.version, list(self.batch.queue), closed),
            ctl.world.layout.leader(sw.cell),
        )
        self.trainers[sw.cell] = t2
        self.record(sw, "sampling→training", drain_s=t1 - t0, switch_s=t2 - t1, w=self.d - self.f)

    def to_sampling(self, sw: Switch) -> None:
        ctl = self.ctl
        t0 = time.monotonic()
        ctl.switch({sw.cell: Role.SAMPLING})
        t1 = time.monotonic()
        ctl.load_weights(ctl.version, [sw.cell])
        t2 = time.monotonic()
        ctl.serving.set_sampling({ctl.hellos[u].address for u, r in ctl.roles.items() if r == Role.SAMPLING})
        self.record(sw, "training→sampling", switch_s=t1 - t0, load_s=t2 - t1, admit_s=time.monotonic() - t2)

    def record(self, sw: Switch, kind: str, **phases: float) -> None:
        total = sum(v for k, v in phases.items() if k.endswith("_s"))
        entry = {"cell": sw.cell, "kind": kind, "reason": sw.reason, "seconds": round(total, 4)}
        entry.update({k: round(v, 4) if isinstance(v, float) else v for k, v in phases.items()})
        self.switches.append(entry)
        self.ctl.events.emit("switch", step=self.step, **entry)

    def poll(self) -> None:
        ctl = self.ctl
        ctl.check_alive(time.monotonic())
        got = ctl.channel.poll()
        if got is None:
            time.sleep(POLL_INTERVAL_S)
            return
        msg = got[1]
        if isinstance(msg, Heartbeat):
            ctl.last_seen[msg.cell] = time.monotonic()
        elif isinstance(msg, TrainDone) and msg.step == self.step:
            self.done[msg.cell] = msg
        else:
            raise ProtocolError(f"controller: unexpected {msg!r} in an elastic step")

    def apply(self, tito_bytes: int, trained: set[int]) -> StepApplied:
        num_runs = self.batch.num_runs if self.batch.queue else 0
        if self.carried_in or self.stopped:
            # Runs whose sequences this update trained: a run split by the stop counts in both
            # of the updates that train part of it.
            num_runs = len({s.run_id for i in trained for s in self.batch.queue[i]})
        deadline = time.monotonic() + self.ctl.cells.heartbeat_timeout_s * 4
        return self.ctl.apply_step(self.step, self.done, num_runs, tito_bytes, deadline)
