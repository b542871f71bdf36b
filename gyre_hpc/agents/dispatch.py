"""Running many executions at once against the proxy, reporting the scheduler's counters.

Each execution gets its own run id, workspace and per-role keys. ``on_event`` hears
``dispatched`` (d), ``started`` (p) and ``finished`` (f) for every execution — the counters
of the water-level rule — and each finished execution is scored at once on what it left.

With a journal, an execution the journal shows finished is not run again (its outcome is
returned as it was, with the same d / p / f events), and one it shows under way continues
from its last completed call in the workspace it left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre_hpc.agents.external import CommandHarness, Endpoint, PythonHarness
from gyre_hpc.agents.harness import Harness
from gyre_hpc.agents.journal import Journal
from gyre_hpc.errors import GyreError
from gyre_hpc.execution.outcome import Execution, Outcome
from gyre_hpc.recipe.schema import AgentConfig
from gyre_hpc.sandbox import supervise, untrusted
from gyre_hpc.sandbox.confine import UNCONFINED, Sandbox
from gyre_hpc.scoring import RunArtifacts, ScoringRunner
from gyre_hpc.tasks.task import Task

AnyHarness = Harness | CommandHarness | PythonHarness


def make_harness(
    config: AgentConfig,
    endpoint: Endpoint,
    sampling: dict[str, Any],
    seed: int | None,
    logs: Path,
    sandbox: Sandbox = UNCONFINED,
) -> AnyHarness:
    """The harness ``agent.kind`` names, talking to the model through ``endpoint`` (the proxy),
    running what the agent runs in ``sandbox``."""
    if config.kind == "command":
        return CommandHarness(config, endpoint, logs, sandbox)
    if config.kind == "python":
        return PythonHarness(config, endpoint, sandbox)
    return Harness(
        endpoint.base_url + "/v1", endpoint.key_for, config, sampling, endpoint.model, seed, sandbox,
        url_for=lambda run_id: endpoint.url_for(run_id) + "/v1",
    )  # fmt: skip


SETUP_TIMEOUT_S = 900.0
TIMED = ("timed_out", "stopped")
"""Execution statuses scored as cut short: on what the run left."""


async def setup(task: Task, workspace: Path) -> str | None:
    """Run the task's ``setup`` command in its workspace; what went wrong, or None."""
    if not task.setup:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", task.setup, cwd=workspace, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    except OSError as err:
        return f"setup could not start: {err}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), SETUP_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"setup timed out after {SETUP_TIMEOUT_S:g} s"
    if proc.returncode:
        tail = out.decode(errors="replace").strip().splitlines()[-1:]
        return f"setup exited {proc.returncode}: {' '.join(tail)}"
    return None


def artifacts(ex: Execution, task: Task, task_dir: Path, sandbox: Sandbox = UNCONFINED) -> RunArtifacts:
    """A run that never reached the model at all left nothing of its own: it gets a placeholder."""
    workspace = ex.workspace if not (ex.status == "crashed" and ex.calls == 0) else ex.workspace / "missing"
    # A stopped execution is scored on what it left, as one cut at its time limit is.
    status = "finished" if ex.status == "finished" else "timed_out" if ex.status in TIMED else "crashed"
    try:
        sandbox = sandbox.for_task(task)
    except GyreError:
        pass  # it never ran in it: scored on the placeholder, as a crash before any call is
    return RunArtifacts(ex.run_id, workspace, status, task.for_scorer(task_dir), sandbox, ex.summary)


class Dispatcher:
    def __init__(
        self,
        harness: AnyHarness,
        scoring: Callable[[Task], ScoringRunner],
        workspaces: Path,
        task_dir: Path,
        concurrency: int,
        on_event: Callable[[str, str], None] = lambda kind, run: None,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        journal: Journal | None = None,
        stops: dict[str, asyncio.Event] | None = None,
    ) -> None:
        self.harness, self.scoring, self.journal = harness, scoring, journal
        self.stops = {} if stops is None else stops
        """Run id → the event that stops it (``Serving.stop_runs``), while it has not ended."""
        self.workspaces, self.task_dir = workspaces, task_dir
        self.limit = asyncio.Semaphore(concurrency)
        self.on_event = on_event
        self.on_outcome = on_outcome

    async def run_all(self, jobs: list[tuple[str, Task]]) -> list[Outcome]:
        for run_id, _ in jobs:
            self.stops[run_id] = asyncio.Event()
            self.on_event("dispatched", run_id)
        return list(await asyncio.gather(*(self._one(run_id, task) for run_id, task in jobs)))

    async def run_one(self, run_id: str, task: Task, stopped: bool = False) -> Outcome:
        """One execution the controller placed here (``executors.node``): it counted the
        dispatch; this reports started and finished. ``stopped``: stopped before it started."""
        stop = self.stops.setdefault(run_id, asyncio.Event())
        if stopped:
            stop.set()
        return await self._one(run_id, task)

    async def _one(self, run_id: str, task: Task) -> Outcome:
        entry = self.journal.load(run_id) if self.journal is not None else None
        if entry is not None and entry.outcome is not None:  # finished before a restart: kept as it was
            self.on_event("started", run_id)
            outcome = Outcome.from_json(entry.outcome)
            self.stops.pop(run_id, None)
            self.on_outcome(outcome)
            self.on_event("finished", run_id)
            return outcome
        async with self.limit:
            self.on_event("started", run_id)
            workspace = self.workspaces / run_id
            try:
                box = await asyncio.to_thread(self.harness.sandbox.for_task, task)  # a tarball unpacks once
                failed = None
            except GyreError as err:  # an image this sandbox cannot run: this execution's failure
                box, failed = self.harness.sandbox, str(err)
            if failed is None and (entry is None or entry.calls == 0):
                await asyncio.to_thread(untrusted.remove, workspace)  # an abandoned attempt's files go
                await asyncio.to_thread(task.materialize, workspace)  # a repository's tree, maybe
                await asyncio.to_thread(box.seed, workspace)  # what its image holds at its workdir
                failed = await setup(task, workspace)  # the task's own command: outside the sandbox
            # Its limits (the task's own where it names them), for all its processes.
            group = await asyncio.to_thread(box.groups.open, run_id)
            try:
                await asyncio.to_thread(self.harness.sandbox.prepare, workspace, group)
                if failed is not None:
                    ex = Execution(
                        run_id=run_id, task_id=task.id, workspace=workspace, status="crashed", error=failed
                    )
                else:
                    stop = self.stops.get(run_id)
                    ex = await self.harness.run(task, workspace, run_id, self.journal, entry, stop, group)
            finally:
                await asyncio.to_thread(group.close)  # nothing it started outlives it
            score = await supervise.aside(
                self.scoring(task).score, artifacts(ex, task, self.task_dir, self.harness.sandbox)
            )
            outcome = Outcome(execution=ex, score=score)
            if self.journal is not None and ex.status != "crashed":
                # A crash may be the failure a restart recovers from: such an execution continues.
                self.journal.finish(run_id, outcome.to_json())
            self.stops.pop(run_id, None)
            self.on_outcome(outcome)  # before "finished": a consumer counting f sees it first
            self.on_event("finished", run_id)
            return outcome
