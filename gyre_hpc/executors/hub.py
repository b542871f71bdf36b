"""The controller's side of executor nodes: a queue of executions, placed on nodes by free slots.

```
 controller (serving loop)                                   executor node (executors.node)
  run_all(jobs) ─▶ queue ─▶ place(free slots) ─▶ outbox ◀── POST /executors/claim  (long poll,
                                                              = heartbeat; free slots implied)
  d counted here; p, f and the scored outcome   ◀─────────── POST /executors/report
  stop(runs) ─▶ the owning node's stop list  ──────────────▶ (in the next claim's reply)
  reaper: a node silent past lease_s is lost ─▶ its executions go to the front of the queue
```

An execution is placed on one node at a time. A node that is lost (killed, its host gone, its
network cut) loses its executions: each is placed again, where the built-in harness continues
it from its journal on the shared run directory and a black-box one starts again. A report
about an execution the node no longer holds (it was placed elsewhere meanwhile) is ignored, and
the node is told to abandon it, so no execution is counted twice.

Every request carries the hub's token (``executors.job.HubAddress``), which only the runtime
reads: an execution, which can reach the proxy, cannot reach this. The hub knows nothing of
harnesses, sandboxes or scoring: an outcome arrives scored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from gyre_hpc.errors import GyreError
from gyre_hpc.execution.outcome import Outcome
from gyre_hpc.executors.job import Job
from gyre_hpc.executors.slots import place
from gyre_hpc.observability import events as ev
from gyre_hpc.proxy.keys import bearer_is
from gyre_hpc.recipe.schema import ExecutorsConfig
from gyre_hpc.tasks.task import Task

log = logging.getLogger(__name__)
CLAIM_WAIT_S = 1.0
"""How long a claim waits for work before it returns empty (and the node claims again)."""
NO_NODE_S = 300.0
"""Queued work with no executor node up this long fails the dispatch, naming why."""


@dataclass(eq=False)
class Pending:
    """One execution from dispatch until its outcome is in."""

    job: Job
    done: asyncio.Future[Outcome]
    on_outcome: Callable[[Outcome], None]
    started: bool = False
    node: str | None = None


@dataclass(eq=False)
class Node:
    """An executor node as the hub sees it."""

    name: str
    slots: int
    seen: float
    held: dict[str, Pending] = field(default_factory=dict)
    outbox: list[dict[str, Any]] = field(default_factory=list)
    stops: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def free(self) -> int:
        return self.slots - len(self.held)


class Hub:
    def __init__(
        self,
        config: ExecutorsConfig,
        token: str,
        on_event: Callable[[str, str], None],
        emit: Callable[[ev.Event], None],
        usage: Callable[[str], tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reap_every_s: float | None = None,
    ) -> None:
        """``on_event``: the d / p / f counters (as ``agents.dispatch.Dispatcher`` reports them);
        ``usage``: calls and tokens the proxy recorded per run, for harnesses that count none;
        ``reap_every_s``: how often leases are checked (default: a quarter lease, at most 1 s)."""
        self.config, self.token, self.on_event, self.emit = config, token, on_event, emit
        self.usage, self.clock = usage, clock
        self.reap_every_s = reap_every_s or min(config.lease_s / 4, 1.0)
        self.nodes: dict[str, Node] = {}
        self.queue: deque[Pending] = deque()
        self.pending: dict[str, Pending] = {}
        self._idle_since = clock()
        self._reaper: asyncio.Task[None] | None = None
        self._registered = asyncio.Event()

    async def wait_for_nodes(self, n: int, timeout_s: float) -> int:
        """Wait until ``n`` nodes are up (or ``timeout_s`` passed): how many are."""
        deadline = self.clock() + timeout_s
        while len(self.nodes) < n and (left := deadline - self.clock()) > 0:
            self._registered.clear()
            try:
                await asyncio.wait_for(self._registered.wait(), left)
            except TimeoutError:
                break
        return len(self.nodes)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)  # an outcome holds the execution's record
        app.router.add_post("/executors/register", self._register)
        app.router.add_post("/executors/claim", self._claim)
        app.router.add_post("/executors/report", self._report)
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._stop_reaper)
        return app

    async def run_all(
        self,
        jobs: list[tuple[str, Task]],
        workspaces: Path,
        journal: Path | None,
        on_outcome: Callable[[Outcome], None],
    ) -> list[Outcome]:
        """Queue ``jobs`` on the executor nodes; their outcomes, in order, once all are in."""
        batch, loop = [], asyncio.get_running_loop()
        for run_id, task in jobs:
            p = Pending(Job(run_id, task, workspaces, journal), loop.create_future(), on_outcome)
            self.pending[run_id] = p
            self.queue.append(p)
            batch.append(p)
            self.on_event("dispatched", run_id)
        self._place()
        return list(await asyncio.gather(*(p.done for p in batch)))

    def stop(self, run_ids: list[str]) -> None:
        """End these executions now: each is scored on what it left, where it runs."""
        for run in run_ids:
            p = self.pending.get(run)
            if p is None:
                continue
            p.job = replace(p.job, stopped=True)
            if p.node is not None:
                node = self.nodes[p.node]
                node.stops.add(run)
                node.wake.set()

    def _place(self) -> None:
        live = {name: n.free for name, n in self.nodes.items()}
        for name in place(live, len(self.queue)):
            p = self.queue.popleft()
            node = self.nodes[name]
            p.node = name
            node.held[p.job.run_id] = p
            node.outbox.append(p.job.to_json())
            node.wake.set()
            self.emit(ev.Placed(run=p.job.run_id, node=name, attempt=p.job.attempt))

    # ---- HTTP: every handler checks the token before it reads anything else ----

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not bearer_is(request.headers.get("Authorization", ""), self.token):
            raise web.HTTPUnauthorized(text="unknown executor token")
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="the body is not JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("node"), str):
            raise web.HTTPBadRequest(text="the body must be an object naming its node")
        return body

    async def _register(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name, slots = body["node"], body.get("slots")
        if not isinstance(slots, int) or slots < 1:
            raise web.HTTPBadRequest(text="slots must be a positive integer")
        if name in self.nodes:  # the node started again: what it held is lost with its process
            self._lose(self.nodes.pop(name), 0.0)
        self.nodes[name] = Node(name, slots, self.clock())
        self._registered.set()
        self.emit(
            ev.ExecutorUp(node=name, host=str(body.get("host", "")), pid=int(body.get("pid", 0)), slots=slots)
        )
        self._place()
        return web.json_response({})

    async def _claim(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        node = self.nodes.get(body["node"])
        if node is None:
            return web.json_response({"error": "register"}, status=409)
        node.seen = self.clock()
        if not node.outbox and not node.stops:
            node.wake.clear()
            try:
                await asyncio.wait_for(node.wake.wait(), CLAIM_WAIT_S)
            except TimeoutError:
                pass
            if self.nodes.get(node.name) is not node:  # lost while it waited
                return web.json_response({"error": "register"}, status=409)
            node.seen = self.clock()
        jobs, node.outbox = node.outbox, []
        stops = sorted(node.stops & set(node.held))
        node.stops.clear()
        running = body.get("running", [])
        abandon = [r for r in running if isinstance(r, str) and r not in node.held]
        return web.json_response({"jobs": jobs, "stop": stops, "abandon": abandon})

    async def _report(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        node = self.nodes.get(body["node"])
        if node is None:
            return web.json_response({"error": "register"}, status=409)
        node.seen = self.clock()
        for run in body.get("started", []):
            p = node.held.get(run)
            if p is not None and not p.started:  # a continued execution started once
                p.started = True
                self.on_event("started", run)
        for item in body.get("outcomes", []):
            p = node.held.pop(item.get("run"), None) if isinstance(item, dict) else None
            if p is None:
                continue  # placed elsewhere since: that placement's outcome counts
            if "error" in item:  # what would have failed the dispatch on the controller
                del self.pending[p.job.run_id]
                err = GyreError(f"execution {p.job.run_id} failed on executor {node.name}: {item['error']}")
                if not p.done.done():
                    p.done.set_exception(err)
                continue
            try:
                outcome = Outcome.from_json(item["outcome"])
                if outcome.execution.run_id != p.job.run_id:
                    raise ValueError(f"it names run {outcome.execution.run_id!r}")
            except (KeyError, TypeError, ValueError) as err:
                log.warning("executor %s sent a malformed outcome for %s: %s", node.name, p.job.run_id, err)
                self._requeue(p)
                continue
            self._finish(p, outcome)
        self._place()
        return web.json_response({})

    def _finish(self, p: Pending, outcome: Outcome) -> None:
        ex = outcome.execution
        if self.usage is not None:
            ex.calls, ex.tokens = self.usage(ex.run_id)  # a black-box harness counts nothing itself
        if not p.started:
            self.on_event("started", ex.run_id)
        del self.pending[ex.run_id]
        p.on_outcome(outcome)  # before "finished": a consumer counting f sees it first
        self.on_event("finished", ex.run_id)
        if not p.done.done():
            p.done.set_result(outcome)

    def _requeue(self, p: Pending) -> None:
        p.node = None
        p.job = replace(p.job, attempt=p.job.attempt + 1)
        self.queue.appendleft(p)

    def _lose(self, node: Node, silent_s: float) -> None:
        runs = sorted(node.held)
        log.warning(
            "executor %s lost (silent %.1f s): placing %d executions again", node.name, silent_s, len(runs)
        )
        self.emit(ev.ExecutorLost(node=node.name, runs=runs, silent_s=round(silent_s, 3)))
        for run in reversed(runs):
            self._requeue(node.held[run])
        node.held.clear()
        node.wake.set()  # a claim waiting on it returns

    # ---- the lease ----

    async def _start_reaper(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def _stop_reaper(self, app: web.Application) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.reap_every_s)
            self.reap()

    def reap(self) -> None:
        """Lose every node silent past the lease; fail the queue when no node has been up for
        ``NO_NODE_S``."""
        now = self.clock()
        for node in [n for n in self.nodes.values() if now - n.seen > self.config.lease_s]:
            del self.nodes[node.name]
            self._lose(node, now - node.seen)
        self._place()
        if self.nodes or not self.queue:
            self._idle_since = now
        elif now - self._idle_since > NO_NODE_S:
            err = GyreError(
                f"no executor node has been up for {NO_NODE_S:g} s with {len(self.queue)} executions "
                "queued (executors.nodes > 0): see the executors' logs in the run directory"
            )
            while self.queue:
                p = self.queue.popleft()
                del self.pending[p.job.run_id]
                if not p.done.done():
                    p.done.set_exception(err)
