"""An executor node: runs the executions the controller places on it, exactly as the controller
would (``python -m gyre_hpc.executors RUN_DIR``; ``gyre-hpc submit`` starts one per executor node,
``gyre-hpc run`` one local process per ``executors.nodes``).

```
 find the hub (run_dir/executors/hub.json) ─▶ register (node, slots)
   ┌─▶ claim (long poll; the heartbeat) ─▶ jobs ─▶ Dispatcher.run_one ─ harness ⇄ proxy (network)
   │                                     ─▶ stop / abandon                 └─ scored here, in the
   └── report: started, outcomes ◀────────────────────────────────────────    task's image
 lost (the hub says so) or the hub gone ─▶ abandon everything ─▶ find the hub (maybe a new one)
```

Each execution runs through ``agents.dispatch.Dispatcher`` with the run's own sandbox, harness
and scorers: sandboxing, limits, journals and scoring are the controller's rules, on this node.
Its model calls go to the proxy's URL with its per-execution keys, minted here from the run's
``proxy.secret`` (the run directory is shared storage). The node knows nothing of steps, cells or
training; it exits when the launcher stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from gyre_hpc.agents.dispatch import AnyHarness, Dispatcher, make_harness
from gyre_hpc.agents.external import Endpoint
from gyre_hpc.agents.journal import Journal
from gyre_hpc.executors.job import HubAddress, Job
from gyre_hpc.launch.env import JobEnvironment
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.recipe.schema import Recipe
from gyre_hpc.rundir import RunDir
from gyre_hpc.sandbox.confine import for_run
from gyre_hpc.scoring import ScoringRunners

log = logging.getLogger("gyre_hpc.executors")
FIND_EVERY_S = 0.2


class Lost(Exception):
    """The hub does not know this node (any more): register again."""


class ExecutorNode:
    def __init__(self, run_dir: RunDir, recipe: Recipe, name: str, host: str, slots: int) -> None:
        self.run_dir, self.recipe, self.name, self.host, self.slots = run_dir, recipe, name, host, slots
        self.running: dict[str, asyncio.Task[None]] = {}
        self.started: list[str] = []
        self.outcomes: list[dict[str, Any]] = []
        self.report_now = asyncio.Event()
        self.stops: dict[str, asyncio.Event] = {}
        self.dispatchers: dict[tuple[Path, Path | None], Dispatcher] = {}
        self.scoring = ScoringRunners(recipe.scoring)
        warnings: list[str] = []
        self.sandbox = for_run(
            recipe.agent, run_dir.path, recipe.tasks.suite, warnings.append, recipe.scoring.sandbox_binds
        )
        for line in warnings:
            log.warning("%s", line)

    async def serve(self) -> None:
        """Serve hub after hub (a restarted world writes a new one) until cancelled."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            while True:
                hub = await self.find_hub()
                try:
                    await self.serve_hub(http, hub)
                except (Lost, aiohttp.ClientError, TimeoutError) as err:
                    # Lost (silent past its lease): the hub has placed its executions elsewhere, so
                    # it drops them and registers again. Unreachable: the world may be restarting,
                    # and the next hub continues them from their journals.
                    log.warning(
                        "hub %s: %s; abandoning %d executions", hub.url, err or "lost", len(self.running)
                    )
                    await self.abandon(list(self.running))
                    await asyncio.sleep(FIND_EVERY_S)

    async def find_hub(self) -> HubAddress:
        """The hub the run directory names now (a restarted world writes a new one)."""
        while (hub := HubAddress.read(self.run_dir.executor_hub)) is None:
            await asyncio.sleep(FIND_EVERY_S)
        return hub

    async def serve_hub(self, http: aiohttp.ClientSession, hub: HubAddress) -> None:
        self.harness = self.make_harness(hub)
        headers = {"Authorization": f"Bearer {hub.token}"}
        me = {"node": self.name, "host": self.host, "pid": os.getpid(), "slots": self.slots}
        await self.post(http, hub, "register", me, headers)
        log.info("registered with %s as %s (%d slots)", hub.url, self.name, self.slots)
        reporter = asyncio.create_task(self.report_loop(http, hub, headers))
        try:
            while True:
                reply = await self.post(
                    http, hub, "claim", {"node": self.name, "running": list(self.running)}, headers
                )
                await self.abandon(reply.get("abandon", []))
                for run in reply.get("stop", []):
                    if run in self.stops:
                        self.stops[run].set()
                for data in reply.get("jobs", []):
                    job = Job.from_json(data)
                    self.running[job.run_id] = asyncio.create_task(self.run(job))
                if reporter.done():
                    reporter.result()  # its error ends this hub
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reporter

    async def post(
        self,
        http: aiohttp.ClientSession,
        hub: HubAddress,
        verb: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> dict[str, Any]:
        async with http.post(f"{hub.url}/executors/{verb}", json=body, headers=headers) as resp:
            if resp.status == 409:
                raise Lost(f"the hub does not know {self.name}")
            if resp.status != 200:
                raise aiohttp.ClientError(f"{verb}: HTTP {resp.status}: {(await resp.text())[:200]}")
            return await resp.json()

    async def report_loop(
        self, http: aiohttp.ClientSession, hub: HubAddress, headers: dict[str, str]
    ) -> None:
        """Send what happened as it happens; what a failed send held is sent with the next."""
        while True:
            await self.report_now.wait()
            self.report_now.clear()
            started, self.started = self.started, []
            outcomes, self.outcomes = self.outcomes, []
            try:
                await self.post(
                    http,
                    hub,
                    "report",
                    {"node": self.name, "started": started, "outcomes": outcomes},
                    headers,
                )
            except BaseException:
                self.started, self.outcomes = started + self.started, outcomes + self.outcomes
                raise

    def make_harness(self, hub: HubAddress) -> AnyHarness:
        e = self.recipe.engine
        sampling = {"temperature": e.temperature, "top_p": e.top_p, "max_tokens": e.max_new_tokens}
        keys = KeyRing.load(self.run_dir.proxy_secret)
        # The hub counts a black-box harness's usage; each run's calls go to its own proxy worker.
        endpoint = Endpoint(hub.proxy_url, keys.mint, hub.model, workers=tuple(hub.proxy_workers))
        logs = self.run_dir.execution_logs
        return make_harness(self.recipe.agent, endpoint, sampling, self.recipe.run.seed, logs, self.sandbox)

    def dispatcher(self, job: Job) -> Dispatcher:
        key = (job.workspaces, job.journal)
        if key not in self.dispatchers:
            journal = Journal(job.journal) if job.journal is not None and self.recipe.agent.journal else None
            self.dispatchers[key] = Dispatcher(
                self.harness,
                lambda task: self.scoring.get(task.scorer),
                job.workspaces,
                self.run_dir.task_files,
                self.slots,  # the hub places no more than the free slots
                self.on_event,
                journal=journal,
                stops=self.stops,
            )
        d = self.dispatchers[key]
        d.harness = self.harness  # a new hub's proxy
        return d

    async def run(self, job: Job) -> None:
        try:
            outcome = await self.dispatcher(job).run_one(job.run_id, job.task, stopped=job.stopped)
        except asyncio.CancelledError:
            return  # abandoned: the hub placed it elsewhere
        except Exception as err:  # noqa: BLE001 - it fails the dispatch, as it would on the controller
            log.exception("execution %s failed on this node", job.run_id)
            self.outcomes.append({"run": job.run_id, "error": f"{type(err).__name__}: {err}"})
        else:
            self.outcomes.append({"run": job.run_id, "outcome": outcome.to_json()})
        finally:
            self.running.pop(job.run_id, None)
        self.report_now.set()

    def on_event(self, kind: str, run_id: str) -> None:
        if kind == "started":
            self.started.append(run_id)
            self.report_now.set()

    async def abandon(self, runs: list[str]) -> None:
        tasks = [self.running.pop(r) for r in runs if r in self.running]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_hpc.executors", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--node", default="", help="its name in events; default: the Slurm node name")
    args = parser.parse_args(argv)
    run_dir = RunDir(args.run_dir)
    env = JobEnvironment.from_environ()
    name = args.node or env.node_name
    logging.basicConfig(
        filename=run_dir.executor_log(name),
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    recipe = run_dir.read_recipe()
    node = ExecutorNode(run_dir, recipe, name, env.hostname, recipe.executors.slots_per_node)
    return asyncio.run(serve_until_signalled(node))


async def serve_until_signalled(node: ExecutorNode) -> int:
    """Serve until SIGTERM or SIGINT, then end every execution here (their processes with them)."""
    serving = asyncio.create_task(node.serve())
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, serving.cancel)
    try:
        await serving
    except asyncio.CancelledError:
        pass
    finally:
        await node.abandon(list(node.running))
    return 0


if __name__ == "__main__":
    sys.exit(main())
