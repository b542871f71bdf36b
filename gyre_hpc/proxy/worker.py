"""One proxy worker process (``proxy.workers`` > 1): the proxy for the runs of one shard.

```
 controller (runtime.serving)                        worker n  (python -m gyre_hpc.proxy.worker RUN_DIR n)
   proxy/spec.json (engines, limits, token) ──────▶  Proxy(worker=n): runs with shard_of(run) = n,
   ◀── proxy/worker-n.json (its URL, once up)          TITO segment tito[-n].bin, chats[-n].jsonl
   POST /gyre/admin/{sampling,hold,loaded} ──────▶   its router: the same verbs as in one process
   harness ── /v1/… (run key) ───────────────────▶   serves it, or 421 when the run is another's
```

The worker is the same ``proxy.server.Proxy`` that serves a single-process run; what it adds is
the control verbs over HTTP, behind the token the controller wrote in ``spec.json`` (mode 600,
never shown to an execution). It knows nothing of steps or cells; it exits on SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from gyre_hpc.diskspace import describe
from gyre_hpc.faults.points import FaultPoints
from gyre_hpc.proxy.address import reachable_url
from gyre_hpc.proxy.keys import bearer_is, write_private_json
from gyre_hpc.proxy.server import Proxy
from gyre_hpc.rundir import RunDir

ADMIN = "/gyre/admin/"


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker serves: the controller writes it once before it starts them."""

    model_dir: str
    engines: list[str]
    limits: dict[str, int]
    """Calls in flight each engine admits from one worker: its share of the engine's limit."""
    workers: int
    token: str
    faults: list[str] = dataclasses.field(default_factory=list)
    """The fault points a test armed (``GYRE_FAULT``); a worker's number is its index."""

    def write(self, path: Path) -> None:
        write_private_json(path, dataclasses.asdict(self))

    @classmethod
    def read(cls, path: Path) -> WorkerSpec:
        return cls(**json.loads(path.read_text()))


def share(limit: int, workers: int) -> int:
    """One worker's share of an engine's admission limit: together they admit the limit, give or
    take a worker's rounding, and each admits at least one call."""
    return max(1, -(-limit // workers))


def admin_routes(app: web.Application, proxy: Proxy, token: str) -> None:
    """The controller's verbs on this worker's router, each a POST of JSON behind ``token``."""

    async def verb(request: web.Request) -> web.Response:
        if not bearer_is(request.headers.get("Authorization", ""), token):
            raise web.HTTPUnauthorized(text="unknown admin token")
        body: dict[str, Any] = await request.json()
        urls = [u for u in body.get("urls", []) if u in proxy.router.engines]
        name = request.match_info["verb"]
        if name == "sampling":  # admit on these, drain the rest
            for url in proxy.router.engines:
                if url in urls:
                    await proxy.router.undrain(url)
                elif proxy.router.engines[url].admitting:
                    await proxy.router.drain(url, body.get("drain_mode", proxy.config.drain_mode))
        elif name == "hold":
            for url in urls:
                await proxy.router.hold(url)
        elif name == "loaded":
            for url in urls:
                await proxy.router.loaded(url, int(body["version"]))
        elif name == "occupancy":
            return web.json_response(proxy.router.occupancy())
        else:
            raise web.HTTPNotFound(text=f"no verb {name!r}; valid: sampling, hold, loaded, occupancy")
        return web.json_response({})

    app.router.add_post(ADMIN + "{verb}", verb)


async def serve(run_dir: RunDir, index: int) -> int:
    spec = WorkerSpec.read(run_dir.proxy_spec)
    recipe = run_dir.read_recipe()
    config = dataclasses.replace(recipe.proxy, admission_limit=0)  # the spec's limits are this worker's share
    proxy = Proxy(
        run_dir.path,
        spec.model_dir,
        spec.engines,
        config,
        1,
        spec.limits,
        index,
        spec.workers,
        routes=recipe.trainer.routing_replay,
    )
    proxy.faults = FaultPoints.of(tuple(spec.faults), index, run_dir.fault_markers)
    app = proxy.app()
    admin_routes(app, proxy, spec.token)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    port = config.port + index if config.port else 0
    await web.TCPSite(runner, config.host, port).start()
    url = reachable_url(config.host, runner.addresses[0][1])
    where = run_dir.proxy_worker(index)
    where.with_suffix(".tmp").write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(where.with_suffix(".tmp"), where)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:  # until told to stop, or until its TITO segment cannot be written (a full disk)
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(proxy.tito.failed.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
    finally:
        await runner.cleanup()
    if proxy.tito.broken is None:
        return 0
    print(f"proxy worker {index}: {describe(proxy.tito.broken, run_dir.path)}", file=sys.stderr, flush=True)
    return 3


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m gyre_hpc.proxy.worker RUN_DIR INDEX", file=sys.stderr)
        return 2
    return asyncio.run(serve(RunDir(Path(args[0])), int(args[1])))


if __name__ == "__main__":
    sys.exit(main())
