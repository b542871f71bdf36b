"""The engine a cell hosts: the embedded, emulated or SGLang server behind the verbs a cell needs.

```
 cell leader ─ start() → URL        before the cell's Hello: the proxy's endpoint for this cell
             ─ pause() / resume()   around training (the proxy has drained it first); an SGLang
                                    server's memory follows ``engines.colocation``
             ─ load(weights, v)     a new version: the core's flat snapshot, or whole tensors
                                    streamed from the cell's slices (``engines.staging``)
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
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from aiohttp import web

from gyre_hpc.engines.colocation import CONTINUE, LOAD, PAUSE, START, State, step
from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.emulated import EmulatedEngine
from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.engines.server import make_app
from gyre_hpc.engines.sglang import HeadPeers, PartPeers, PartPush, SGLangServer, Span
from gyre_hpc.engines.staging import Tensors
from gyre_hpc.errors import LaunchError
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.plan.memory import Shape
from gyre_hpc.recipe.schema import EngineConfig

log = logging.getLogger(__name__)

Current = Callable[[], tuple[np.ndarray | None, int]]
"""The newest weights a cell holds, and their version: what a restarted server loads (None: the
cell pushes them from its slices once the server is back, ``SGLangHost.wants``)."""


@dataclass(frozen=True, kw_only=True)
class Restart:
    """A server that died and was started again: what the cell reports (an ``engine_restart``)."""

    cause: str
    """What it was doing when it died (``died during pause``, ``died (code -9)``)."""
    attempts: int
    """Starts it took (1: the first came up)."""
    seconds: float
    version: int
    """The version it came back at: the newest the cell held."""


DEATH_WAIT_S = 10.0
"""How long a verb that failed waits for its server's process to end before it calls the failure
the server's death (a reset connection comes a moment before the exit)."""


class HostedEngine(Protocol):
    restarting: bool
    wants: int | None
    """Restarted with no weights to load (its cell streams them): the version it waits for."""
    restarts: list[Restart]
    """Restarts not yet reported: the cell takes them from the front."""

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
    peers: HeadPeers | PartPeers | None = None,
    routes: bool = False,
) -> HostedEngine:
    """The engine ``engine.backend`` names, for one replica of a cell: ``gpu`` is the first GPU
    it may use, ``span`` its part's place when the replica spans nodes (SGLang only), ``peers``
    its other parts (its head, for a part) where weights go by reference; ``routes``: a MoE
    model's server is started able to return routed experts (the embedded engine always is)."""
    device = resolve_device(engine.device)
    if engine.backend == "sglang":
        head = span is None or span.head
        server = SGLangServer(engine, model_dir, work_dir, host, device, gpu, span=span,
                              group_host=group_host, peers=peers if head else None,  # type: ignore[arg-type]
                              routes=routes)  # fmt: skip
        if not head:
            return PartHost(server, peers)  # type: ignore[arg-type]
        return SGLangHost(server, current, engine.restart_attempts, engine.restart_backoff_s)
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
            shape = Shape.of(ModelConfig.load(model_dir))
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
    wants = None  # it never restarts, so never waits for weights

    def __init__(self, engine: Engine, host: str) -> None:
        self.engine, self.host = engine, host
        self.restarts: list[Restart] = []  # it lives in this process: it never restarts alone
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

    def load(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        """A flat snapshot, or a stream of whole tensors (copied in as they arrive)."""
        if isinstance(weights, np.ndarray):
            self.engine.load_flat(torch.from_numpy(weights), str(version))
            return Pushed(sent=weights.nbytes, whole=weights.nbytes, changed=None, elements=weights.size)
        elements = self.engine.load_tensors(weights, str(version))
        return Pushed(sent=4 * elements, whole=4 * elements, changed=None, elements=elements)

    def supervise(self) -> None:
        """It lives in this process: it cannot die alone."""

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.engine.stop()


class PartHost:
    """A part of an SGLang replica across nodes that is not its head: it serves no HTTP and
    takes no verbs (the head's schedulers reach it); it only runs, and it cannot be restarted
    alone (its replica's process group is gone with it), so its death fails the cell. Where
    weights go by reference, it stages each bucket on its node for its TP ranks (``PartPush``);
    else its head's weight group or files reach it."""

    restarting = False
    wants = None  # it never restarts, so never waits for weights

    def __init__(self, server: SGLangServer, peers: PartPeers | None = None) -> None:
        self.server = server
        self.restarts: list[Restart] = []
        self.push: PartPush | None = None if peers is None else server.part_push(peers)

    def start(self) -> int:
        return self.server.start()

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def load(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        return Pushed() if self.push is None else self.push.push(weights, version)

    def supervise(self) -> None:
        if not self.server.alive():
            raise LaunchError(f"a part of an sglang replica across nodes died; see {self.server.log}")

    def stop(self) -> None:
        self.server.stop()


class SGLangHost:
    """A cell's SGLang server, moved between serving, paused and released by
    ``engines.colocation``'s table, and started again if its process dies — found dead between
    messages (``supervise``) or by a verb it failed mid-flight:

    ```
     SERVING/PAUSED/RELEASED ── dies (a verb fails and its process is gone, or supervise finds it) ──▶
       RELEASED: DOWN, nothing started while the trainer holds the GPU; the next resume starts it
       restarting: verbs record their intent (the state they lead to, the newest weights) and return
         └─ in the background: stop, start (up to engine.restart_attempts, backoff doubling from
            engine.restart_backoff_s), load the newest weights, take it to the intended state ─▶ back
         └─ every attempt failed ─▶ the next supervise() raises: the cell fails, naming why
    ```

    The first start is retried the same way. Each restart is kept in ``restarts`` for the cell to
    report."""

    def __init__(
        self, server: SGLangServer, current: Current, attempts: int = 3, backoff_s: float = 1.0
    ) -> None:
        self.server, self.current = server, current
        self.attempts, self.backoff_s = attempts, backoff_s
        self.restarting = False
        self.state = State.SERVING
        self.restarts: list[Restart] = []
        self._lock = threading.Lock()
        self._pending: tuple[np.ndarray, int] | None = None
        """A load while it restarts: what the restarted server loads instead of what it died with."""
        self._thread: threading.Thread | None = None
        self._failed: Exception | None = None
        self._down_cause = ""
        """Why it is DOWN: the restart it gets when its cell samples is reported with it."""
        self.wants: int | None = None
        """Restarted where its cell pushes the weights (``Current`` gave None): the version it
        waits for, paused (a continue meanwhile is held back until they are in)."""
        self._held_back = False

    def start(self) -> int:
        started = time.monotonic()
        attempts = self._start(lambda: None, "start")
        if attempts > 1:
            self.restarts.append(Restart(cause="died while it started", attempts=attempts,
                                         seconds=time.monotonic() - started, version=0))  # fmt: skip
        return self.server.port

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

    def load(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        return self._go("load", weights, version)

    @property
    def can_load(self) -> bool:
        """Its state takes a load (a released or down server holds no weights to overwrite)."""
        return not self.restarting and self.state in (State.SERVING, State.PAUSED)

    def _go(self, verb: str, *weights: object) -> Pushed:
        with self._lock:
            state, verbs = step(self.state, verb, self.releases_memory)
            if verbs == (START,):  # down while its cell trained: it starts now, the GPU its own
                self.state = state
                self._begin_restart(self._down_cause)
                return Pushed()
            if not self.restarting:
                try:
                    pushed = self._send(verbs, weights)
                    self.state = state
                    return pushed
                except Exception as err:
                    if not self._died():
                        raise
                    what = {"train": "pause", "sample": "resume"}.get(verb, verb)  # the cell's word
                    log.warning("sglang server %s died during %s (%s)", self.server.url, what, err)
                    if self._died_now(f"died during {what}", state):
                        return Pushed()
            self.state = state  # the restarted server is taken there
            if verb == "load":
                flat, version = weights
                if isinstance(flat, np.ndarray):
                    self._pending = (np.array(flat, copy=True), int(version))  # type: ignore[arg-type]
                else:  # a stream, read by the cell to its end: pushed again once it is back
                    self._pending = (None, int(version))  # type: ignore[arg-type]
            return Pushed()

    def _send(self, verbs: tuple[str, ...], weights: tuple[object, ...]) -> Pushed:
        pushed = Pushed()
        for name in verbs:
            if name == LOAD and weights[0] is None:
                self.wants = int(weights[1])  # type: ignore[call-overload]
            elif name == LOAD:
                pushed = self.server.load(*weights)  # type: ignore[arg-type]
                if self._held_back:  # the weights it waited for are in: it generates again
                    self.server.send(CONTINUE)
                self.wants, self._held_back = None, False
            elif name == CONTINUE and self.wants is not None:
                self._held_back = True
            else:
                self.server.send(name)
        return pushed

    def _died(self) -> bool:
        proc = self.server.proc
        if proc is None:
            return False
        try:
            proc.wait(DEATH_WAIT_S)
        except subprocess.TimeoutExpired:
            return False
        return True

    def supervise(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None
            if self._failed is not None:
                raise self._failed  # it did not come back: the cell fails, naming why
        if self.restarting:
            return
        with self._lock:
            if not self.restarting and self.state != State.DOWN and not self.server.alive():
                code = self.server.proc.returncode if self.server.proc else None
                log.warning("sglang server %s died (code %s)", self.server.url, code)
                self._died_now(f"died (code {code})", self.state)

    def _died_now(self, cause: str, state: State) -> bool:
        """Under the lock, for a server that died in (or on its way to) ``state``: restart it
        now, or (its cell trains on the GPU) leave it down until the cell samples, so that it
        sizes its KV pool with the GPU its own. True: down."""
        state, verbs = step(state, "died", self.releases_memory)
        if verbs == (START,):
            self._begin_restart(cause)
            return False
        log.warning("sglang server %s: started again when its cell samples", self.server.url)
        self.state, self._down_cause = state, cause
        return True

    def _begin_restart(self, cause: str) -> None:
        """Under the lock: restarting from now, in a thread of its own, at the newest weights."""
        self.restarting, self._failed, self._pending = True, None, None
        flat, version = self.current()  # now, before the cell's buffers move on
        self._thread = threading.Thread(
            target=self._restart, args=(flat, version, cause), name="sglang-restart", daemon=True
        )
        self._thread.start()

    def _restart(self, flat: np.ndarray, version: int, cause: str) -> None:
        """On the same port, so the proxy's endpoint stays; the proxy sends the calls it had there
        to the other engines meanwhile (their connection errors reroute them)."""
        started = time.monotonic()
        held = {"weights": (flat, version)}

        def come_back() -> None:  # under the lock: verbs wait, then find it back
            weights = self._pending or held["weights"]
            self.state, verbs = step(self.state, "restarted", self.releases_memory)
            self.wants, self._held_back = None, False
            self._send(verbs, weights)
            if self.wants is not None and self.state == State.SERVING:  # no weights yet: not serving
                self.server.send(PAUSE)
                self._held_back = True
            held["weights"], self._pending, self.restarting = weights, None, False

        try:
            attempts = self._start(come_back, cause)
        except Exception as err:
            self._failed = err
            return
        version = held["weights"][1]
        self.restarts.append(Restart(cause=cause, attempts=attempts, seconds=time.monotonic() - started,
                                     version=version))  # fmt: skip
        log.info("sglang server %s back at version %d", self.server.url, version)

    def _start(self, then: Callable[[], None], why: str) -> int:
        """Start the server, then ``then`` under the lock, up to ``attempts`` times with backoff;
        how many it took. Past the bound, one ``LaunchError`` naming the last failure."""
        for attempt in range(1, self.attempts + 1):
            try:
                self.server.stop()
                self.server.start()
                with self._lock:
                    then()
                return attempt
            except Exception as err:
                if attempt == self.attempts:
                    raise LaunchError(
                        f"sglang server {self.server.url} ({why}) did not come up in {self.attempts} "
                        f"attempts (engine.restart_attempts); the last: {err}; see {self.server.log}"
                    ) from None
                wait = self.backoff_s * 2 ** (attempt - 1)
                log.warning("sglang server %s: start %d failed (%s); again in %.1f s",
                            self.server.url, attempt, err, wait)  # fmt: skip
                time.sleep(wait)
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.server.stop()
