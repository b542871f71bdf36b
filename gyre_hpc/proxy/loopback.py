"""Embedded engines and the proxy on loopback, in this process: what ``eval`` and tests run.

The servers are the real ones (aiohttp on 127.0.0.1, ports chosen by the OS); the caller gets
the proxy's OpenAI base URL and a way to mint per-execution keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.server import make_app
from gyre_hpc.proxy.server import Proxy
from gyre_hpc.recipe.schema import ProxyConfig


class LoopbackServing:
    def __init__(
        self, model: Path, run_dir: Path, engines: int, proxy: ProxyConfig, capacity: int, **engine_kw: Any
    ) -> None:
        self.model, self.run_dir, self.n = model, run_dir, engines
        self.proxy_config, self.capacity, self.engine_kw = proxy, capacity, engine_kw

    async def __aenter__(self) -> LoopbackServing:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.engines: list[Engine] = []
        self.runners: list[web.AppRunner] = []
        self.engine_urls: list[str] = []
        for _ in range(self.n):
            engine = Engine(self.model, max_running=self.capacity, **self.engine_kw).start()
            self.engines.append(engine)
            self.engine_urls.append(await self._serve(make_app(engine)))
        self.proxy = Proxy(self.run_dir, self.model, self.engine_urls, self.proxy_config, self.capacity)
        self.proxy_url = await self._serve(self.proxy.app())
        self.url = self.proxy_url + "/v1"
        return self

    async def _serve(self, app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)  # a client gone: its work stops
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def __aexit__(self, *exc: object) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()
        for engine in self.engines:
            engine.stop()

    def key(self, run_id: str, role: str) -> str:
        return self.proxy.keys.mint(run_id, role)
