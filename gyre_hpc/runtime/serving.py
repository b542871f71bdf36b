"""The controller's HTTP side: proxy, harness and dispatcher on one asyncio loop in a thread.

```
 controller main thread (MPI, schedule)          serving thread (asyncio)
   dispatch(jobs) ──run_coroutine_threadsafe──▶  Dispatcher ─▶ Harness ─▶ Proxy ─▶ engines (cells)
   future.done()? ◀─────────────────────────────  outcomes (scored)
   trees(runs), set_sampling(urls) ──────────▶   TITO trees, router admits / drains
   hold(urls), loaded(urls, v) ──────────────▶   around a load: calls stop, go on at v
```

MPI stays on the main thread; everything HTTP stays on the loop. The counters d/p/f are
reported through ``on_event`` from the loop thread. With executor nodes (``executors.nodes``),
``dispatch`` queues executions on the hub (``executors.hub``) instead of running them here; the
hub listens beside the proxy and its address goes to ``executors/hub.json`` in the run directory.
With ``proxy.workers`` > 1 the proxy is that many processes (``proxy.workers``): the verbs go to
all of them, the trees are read from their TITO segments, and each execution is told its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from gyre_hpc.agents.dispatch import Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.agents.journal import Journal
from gyre_hpc.execution.outcome import Outcome
from gyre_hpc.executors.hub import Hub
from gyre_hpc.executors.job import HubAddress
from gyre_hpc.observability import events as ev
from gyre_hpc.proxy.address import reachable_url
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.proxy.server import Proxy, admission_limits
from gyre_hpc.proxy.workers import UP_S as WORKERS_UP_S
from gyre_hpc.proxy.workers import ProxyWorkers, check_same_workers
from gyre_hpc.recipe.schema import AgentConfig, EngineConfig, ExecutorsConfig, ProxyConfig, ScoringConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.sandbox.confine import UNCONFINED, Sandbox
from gyre_hpc.scoring import ScoringRunners
from gyre_hpc.tasks.task import Task
from gyre_hpc.trajectory.tree import TrajectoryTree

T = TypeVar("T")
log = logging.getLogger(__name__)
STOP_S = 5.0
EXECUTORS_UP_S = 120.0
"""How long the first burst waits for every executor node to register."""


class Serving:
    def __init__(
        self,
        run_dir: RunDir,
        model_dir: Path,
        engines: dict[str, int],
        *,
        proxy: ProxyConfig,
        agent: AgentConfig,
        engine: EngineConfig,
        scoring: ScoringConfig,
        capacity: int,
        seed: int,
        on_event: Callable[[str, str], None],
        sandbox: Sandbox = UNCONFINED,
        executors: ExecutorsConfig | None = None,
        emit: Callable[[ev.Event], None] = lambda event: None,
        faults: tuple[str, ...] = (),
        routes: bool = True,
    ) -> None:
        self.run_dir, self.model_dir = run_dir, model_dir
        self.engine_urls, self.limits = list(engines), engines
        """Every engine's URL, and the calls each admits at once."""
        self.proxy_cfg, self.agent_cfg, self.engine_cfg = proxy, agent, engine
        self.capacity, self.seed, self.on_event = capacity, seed, on_event
        self.sandbox = sandbox
        self.executors, self.emit = executors or ExecutorsConfig(), emit
        self.faults = faults
        self.routes = routes
        """Record a mixture-of-experts model's routed experts (``trainer.routing_replay``)."""
        """The fault points a test armed, for the proxy workers (``faults.points``)."""
        self.proxy: Proxy | None = None
        self.workers: ProxyWorkers | None = None
        """The proxy: in this process, or several worker processes (``proxy.workers``)."""
        self.hub: Hub | None = None
        """Executions go to executor nodes through it (``executors.nodes`` > 0), else run here."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="serving", daemon=True)
        self.scoring = ScoringRunners(scoring)
        self.stops: dict[str, asyncio.Event] = {}
        """Run id → its stop, for every execution dispatched and not ended (loop thread only)."""

    def start(self) -> str:
        """Start the loop and the proxy (and the executors' hub, and wait for the executor nodes
        so the first burst spreads over them all); returns the proxy's base URL."""
        self._thread.start()
        url = self.call(self._start(), timeout=WORKERS_UP_S + 30)  # proxy workers may take a while
        if self.hub is not None:
            wanted = self.executors.nodes
            up = self.call(self.hub.wait_for_nodes(wanted, EXECUTORS_UP_S), timeout=EXECUTORS_UP_S + 10)
            if up < wanted:  # they may still come; the work waits for the first
                log.warning("%d of %d executor nodes up after %g s", up, wanted, EXECUTORS_UP_S)
        return url

    async def _start(self) -> str:
        self._runners: list[web.AppRunner] = []
        keys = KeyRing.load(self.run_dir.proxy_secret)  # made here, before any worker reads it
        check_same_workers(self.run_dir, self.proxy_cfg.workers)
        if self.proxy_cfg.workers > 1:
            limits = admission_limits(self.proxy_cfg, self.engine_urls, self.capacity, self.limits)
            self.workers = ProxyWorkers(
                self.run_dir, self.model_dir, limits, self.proxy_cfg.workers, faults=self.faults
            )
            urls = tuple(await self.workers.start())
            self.url, self.usage = urls[0], self.workers.usage
        else:
            self.proxy = Proxy(
                self.run_dir.path,
                self.model_dir,
                self.engine_urls,
                self.proxy_cfg,
                self.capacity,
                self.limits,
                routes=self.routes,
            )
            # In-flight calls get a few seconds at shutdown, never longer: a run that ends (or
            # fails) does not wait on executions it will not train.
            runner = web.AppRunner(self.proxy.app(), handler_cancellation=True, shutdown_timeout=STOP_S)
            await runner.setup()
            await web.TCPSite(runner, self.proxy_cfg.host, self.proxy_cfg.port).start()
            self.url, self.usage, urls = (
                reachable_url(self.proxy_cfg.host, runner.addresses[0][1]),
                self.proxy.usage,
                (),
            )
            self._runners.append(runner)
        if self.executors.nodes:
            await self._start_hub(urls)
        e = self.engine_cfg
        sampling = {"temperature": e.temperature, "top_p": e.top_p, "max_tokens": e.max_new_tokens}
        endpoint = Endpoint(self.url, keys.mint, self.model_dir.name, self.usage, workers=urls)
        logs = self.run_dir.execution_logs
        self.harness = make_harness(self.agent_cfg, endpoint, sampling, self.seed, logs, self.sandbox)
        return self.url

    async def _start_hub(self, workers: tuple[str, ...]) -> None:
        """The executors' hub beside the proxy, on the same address; written where they look."""
        token = HubAddress.new_token()
        usage = self.usage if self.agent_cfg.kind != "builtin" else None
        self.hub = Hub(self.executors, token, self.on_event, self.emit, usage)
        runner = web.AppRunner(self.hub.app(), handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, self.proxy_cfg.host, 0).start()
        self._runners.append(runner)
        hub_url = reachable_url(self.proxy_cfg.host, runner.addresses[0][1])
        address = HubAddress(
            hub_url, token, self.url, self.model_dir.name, secrets.token_hex(8), list(workers)
        )
        await asyncio.to_thread(address.write, self.run_dir.executor_hub)

    def check(self) -> None:
        """Raise if a part of the proxy died (a worker process); the controller's wait calls it."""
        if self.workers is not None:
            self.workers.check()
        elif self.proxy is not None and self.proxy.tito.broken is not None:
            raise self.proxy.tito.broken  # its trees are ahead of its file: nothing more is recorded

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def dispatch(
        self,
        jobs: list[tuple[str, Task]],
        workspaces: Path,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        journal: Path | None = None,
    ) -> concurrent.futures.Future[list[Outcome]]:
        if self.hub is not None:
            journal = journal if self.agent_cfg.journal else None
            return asyncio.run_coroutine_threadsafe(
                self.hub.run_all(jobs, workspaces, journal, on_outcome), self.loop
            )
        dispatcher = Dispatcher(
            self.harness,
            lambda task: self.scoring.get(task.scorer),
            workspaces,
            self.run_dir.task_files,
            max(len(jobs), 1),  # the proxy's admission limits pace the engines
            self.on_event,
            on_outcome,
            Journal(journal) if journal is not None and self.agent_cfg.journal else None,
            self.stops,
        )
        return asyncio.run_coroutine_threadsafe(dispatcher.run_all(jobs), self.loop)

    def trees(self, run_ids: list[str]) -> dict[str, TrajectoryTree]:
        async def get() -> dict[str, TrajectoryTree]:
            if self.workers is not None:  # read from their segments, on this loop like every use
                return self.workers.trees(run_ids)
            assert self.proxy is not None
            return {r: self.proxy.tito.trees[r] for r in run_ids if r in self.proxy.tito.trees}

        return self.call(get())

    def stop_runs(self, run_ids: list[str]) -> None:
        """End these executions now; each is scored on what it left (``agents.stops``)."""

        async def stop() -> None:
            for run in run_ids:
                if run in self.stops:
                    self.stops[run].set()
            if self.hub is not None:
                self.hub.stop(run_ids)

        self.call(stop())

    def set_sampling(self, urls: set[str]) -> None:
        """Admit new calls only on ``urls``; the other engines are drained (their calls move)."""

        async def apply() -> None:
            if self.workers is not None:
                await self.workers.set_sampling(urls, self.proxy_cfg.drain_mode)
                return
            assert self.proxy is not None
            for url in self.engine_urls:
                if url in urls:
                    await self.proxy.router.undrain(url)
                elif self.proxy.router.engines[url].admitting:
                    await self.proxy.router.drain(url, self.proxy_cfg.drain_mode)

        self.call(apply())

    def hold(self, urls: set[str]) -> None:
        """Before a load: no new call on ``urls``, their calls stopped where they are (each goes on
        from its partial output once the engine holds the new version)."""

        async def apply() -> None:
            if self.workers is not None:
                await self.workers.hold(urls)
                return
            assert self.proxy is not None
            for url in urls:
                await self.proxy.router.hold(url)

        self.call(apply())

    def loaded(self, urls: set[str], version: int) -> None:
        async def apply() -> None:
            if self.workers is not None:
                await self.workers.loaded(urls, version)
                return
            assert self.proxy is not None
            for url in urls:
                await self.proxy.router.loaded(url, version)

        self.call(apply())

    def occupancy(self) -> dict[str, float]:
        """Each engine's busy slot-seconds since the proxy started (``Router.occupancy``)."""

        async def get() -> dict[str, float]:
            if self.workers is not None:
                return await self.workers.occupancy()
            assert self.proxy is not None
            return self.proxy.router.occupancy()

        return self.call(get())

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                if self.hub is not None:
                    self.run_dir.executor_hub.unlink(missing_ok=True)  # executors wait for the next
                for runner in reversed(self._runners):
                    self.call(runner.cleanup(), timeout=STOP_S + 10)
                if self.workers is not None:
                    self.call(self.workers.stop(STOP_S), timeout=STOP_S + 10)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
