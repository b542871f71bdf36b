"""The engine a cell hosts: the embedded, emulated or SGLang server behind the verbs a cell needs.

```
 cell leader ─ start() → URL        before the cell's Hello: the proxy's endpoint for this cell
             ─ pause() / resume()   around training (the proxy has drained it first); an SGLang
                                    server's memory follows ``engines.colocation``
             ─ load(flat, v)        a new version, from the core's flat snapshot
             ─ supervise()          between messages: a dead server is restarted in the background,
                                    at the newest version the cell holds (``restarting`` meanwhile)
             ─ stop()
```

``EmbeddedHost`` runs the embedded (or emulated) engine in this process behind the SGLang-native
HTTP API, on a loop thread of its own. ``SGLangHost`` owns an ``engines.sglang.SGLangServer``
process. The cell knows nothing about which one it hosts; a host knows nothing about roles.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from aiohttp import web

from gyre_hpc.engines.colocation import LOAD, State, step
from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.emulated import EmulatedEngine
from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.engines.server import make_app
from gyre_hpc.engines.sglang import SGLangServer, Span
from gyre_hpc.errors import LaunchError
from gyre_hpc.models.architecture import Qwen3Config
from gyre_hpc.plan.memory import Shape
from gyre_hpc.recipe.schema import EngineConfig

log = logging.getLogger(__name__)

Current = Callable[[], tuple[np.ndarray, int]]
"""The newest weights a cell holds, and their version: what a restarted server loads."""


class HostedEngine(Protocol):
    restarting: bool

    def start(self) -> int:
        """Serve; the port it listens on."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def load(self, flat: np.ndarray, version: int) -> Pushed:
        """Serve ``flat`` as ``version``; what the load moved."""

    def supervise(self) -> None: ...

    def stop(self) -> None: ...


def resolve_device(device: str) -> str:
    """auto → cuda where torch sees a GPU, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def host_engine(
    engine: EngineConfig,
    model_dir: Path,
    capacity: int,
    host: str,
    work_dir: Path,
    gpu: int,
    current: Current,
    span: Span | None = None,
    group_host: str = "127.0.0.1",
) -> HostedEngine:
    """The engine ``engine.backend`` names, for one replica of a cell: ``gpu`` is the first GPU
    it may use, ``span`` its part's place when the replica spans nodes (SGLang only)."""
    device = resolve_device(engine.device)
    if engine.backend == "sglang":
        server = SGLangServer(
            engine, model_dir, work_dir, host, device, gpu, span=span, group_host=group_host
        )
        return SGLangHost(server, current) if span is None or span.head else PartHost(server)
    if span is not None:
        raise ValueError(f"engine.backend = {engine.backend!r} cannot span nodes; sglang can")
    if engine.backend == "emulated":
        emulated = EmulatedEngine(
            model_dir,
            max_running=capacity,
            decode_s=engine.emulated_decode_s,
            tokens_median=engine.emulated_tokens_median,
            tokens_sigma=engine.emulated_tokens_sigma,
        )
        return EmbeddedHost(emulated, host)
    dtype = torch.float32 if engine.dtype == "auto" else getattr(torch, engine.dtype)
    at = torch.device(f"cuda:{gpu}") if device == "cuda" else torch.device("cpu")
    cache = 0
    if engine.prefix_cache:
        cache = engine.max_total_tokens or CPU_CACHE_TOKENS
        if device == "cuda" and not engine.max_total_tokens:
            free, total = torch.cuda.mem_get_info(at)
            shape = Shape.of(Qwen3Config.load(model_dir))
            cache = cache_tokens(free, total, engine.mem_fraction_static, shape, dtype.itemsize)
    embedded = Engine(model_dir, max_running=capacity, cache_tokens=cache, dtype=dtype, device=at)
    return EmbeddedHost(embedded, host)


CPU_CACHE_TOKENS = 1 << 20
"""Prefix-cache tokens of an embedded engine on the CPU (host memory) unless the recipe says."""


def cache_tokens(free: int, total: int, fraction: float, shape: Shape, itemsize: int) -> int:
    """Prefix-cache tokens an embedded engine on a GPU keeps: half of what ``fraction`` of the
    GPU leaves after its weights (the other half is for the running sequences' own keys and
    values), no more than is free now."""
    budget = min(int(fraction * total), free) - shape.params * itemsize
    return max(0, budget // 2 // shape.kv_bytes_per_token(itemsize))


class EmbeddedHost:
    """An engine of this process behind the SGLang-native HTTP API, on its own loop thread."""

    restarting = False

    def __init__(self, engine: Engine, host: str) -> None:
        self.engine, self.host = engine, host
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-http", daemon=True)

    def start(self) -> int:
        self.engine.weight_version = "0"
        self.engine.start()
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(60)

    async def _serve(self) -> int:
        self.runner = web.AppRunner(make_app(self.engine), handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, 0).start()
        return self.runner.addresses[0][1]

    def pause(self) -> None:
        self.engine.pause("abort")  # the proxy drained it first: nothing is left in flight

    def resume(self) -> None:
        self.engine.resume()

    def load(self, flat: np.ndarray, version: int) -> Pushed:
        self.engine.load_flat(torch.from_numpy(flat), str(version))
        return Pushed(
            sent=flat.nbytes, whole=flat.nbytes, changed=None, elements=flat.size
        )  # copied in this process

    def supervise(self) -> None:
        """It lives in this process: it cannot die alone."""

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.engine.stop()


class PartHost:
    """A part of an SGLang replica across nodes that is not its head: it serves no HTTP and
    takes no verbs (the head's schedulers reach it); it only runs, and it cannot be restarted
    alone (its replica's process group is gone with it), so its death fails the cell."""

    restarting = False

    def __init__(self, server: SGLangServer) -> None:
        self.server = server

    def start(self) -> int:
        return self.server.start()

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def load(self, flat: np.ndarray, version: int) -> Pushed:
        return Pushed()  # its head's weight group reaches it

    def supervise(self) -> None:
        if not self.server.alive():
            raise LaunchError(f"a part of an sglang replica across nodes died; see {self.server.log}")

    def stop(self) -> None:
        self.server.stop()


class SGLangHost:
    """A cell's SGLang server, moved between serving, paused and released by
    ``engines.colocation``'s table, and restarted at the newest version if its process dies."""

    def __init__(self, server: SGLangServer, current: Current) -> None:
        self.server, self.current = server, current
        self.restarting = False
        self.state = State.SERVING
        self.restarts = 0
        self._thread: threading.Thread | None = None
        self._failed: Exception | None = None

    def start(self) -> int:
        return self.server.start()

    @property
    def releases_memory(self) -> bool:
        """A GPU server with the memory saver hands its memory to the trainer while paused."""
        return self.server.device == "cuda" and self.server.engine.enable_memory_saver

    def pause(self) -> None:
        """Only after the proxy drained it: releasing memory under a running request kills it."""
        self._go("train")

    def resume(self) -> None:
        """Memory back (its weights are stale until the cell's next ``load``, which comes before
        the proxy admits calls again), then serve."""
        self._go("sample")

    def load(self, flat: np.ndarray, version: int) -> Pushed:
        return self._go("load", flat, version)

    def _go(self, verb: str, *weights: object) -> Pushed:
        state, verbs = step(self.state, verb, self.releases_memory)
        pushed = Pushed()
        for name in verbs:
            if name == LOAD:
                pushed = self.server.load(*weights)  # type: ignore[arg-type]
            else:
                self.server.send(name)
        self.state = state
        return pushed

    def supervise(self) -> None:
        if self.restarting:
            if self._thread is not None and not self._thread.is_alive():
                self._thread.join()
                self.restarting = False
                if self._failed is not None:
                    raise self._failed  # it did not come back: the cell fails, naming why
            return
        if not self.server.alive():
            code = self.server.proc.returncode if self.server.proc else None
            log.warning("sglang server %s died (code %s): restarting", self.server.url, code)
            self.restarting, self._failed = True, None
            weights = self.current()  # now, before the cell's buffers move on
            self._thread = threading.Thread(target=self._restart, args=weights, name="sglang-restart")
            self._thread.start()

    def _restart(self, flat: np.ndarray, version: int) -> None:
        """On the same port, so the proxy's endpoint stays; the proxy sends the calls it had there
        to the other engines meanwhile (their connection errors reroute them)."""
        try:
            self.server.stop()
            self.server.start()
            self._go("restarted", flat, version)
            self.restarts += 1
            log.info("sglang server %s back at version %d", self.server.url, version)
        except Exception as err:
            self._failed = err

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.server.stop()
