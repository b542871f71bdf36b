"""Routing model calls to engines, and draining an engine without failing any call.

```
 acquire: sticky engine of the run (prefix-cache locality) if it admits and has room,
          else the admitting engine that stays available longest (highest rank), least loaded;
          none → wait until one frees up or the request's deadline (then HTTP 503)
 versions: an engine is admitted only while the router knows the version it holds —
          loaded(url, v) says so; hold(url) before a load stops its calls (each goes on from
          its partial output, a new segment); after a failure (a server that may have
          restarted from its initial weights) it is probed until it reports the version last
          loaded. Every call carries its engine's version as its prefix-cache key (SGLang's
          extra_key), so no call reuses keys/values computed by other weights.
 drain(engine): stop admitting; abort its in-flight calls; each call goes on elsewhere —
          "continue": from its partial output (its KV moved first when the engines can),
          "restart": from scratch — and its TITO record is marked rerouted
 failure: a connection error, a timeout or a 5xx marks the engine down for a moment and the call
          goes on elsewhere; a 4xx is the request's fault and goes back to the client at once;
          a client that goes away aborts its call on the engine
```

The router knows engines by URL and speaks the SGLang-native API through ``EngineClient``;
it knows nothing about chats or the TITO log.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np

from gyre_hpc.engines.client import EngineClient, EngineError, routed_experts
from gyre_hpc.engines.sampling import BadRequest

DrainMode = Literal["continue", "restart"]


class NoEngine(RuntimeError):
    """No engine could serve the call before its deadline (HTTP 503)."""


class Refused(BadRequest):
    """An engine refused the call itself (its 4xx): the client's mistake, not the engine's."""


@dataclass
class _Flight:
    rid: str
    drained: DrainMode | None = None
    kv_handle: str | None = None
    kv_version: int | None = None


@dataclass
class EngineSlot:
    url: str
    limit: int
    rank: int = 0
    """Higher stays available longer (the scheduler's switch order); preferred by new calls."""
    client: EngineClient = field(init=False)
    admitting: bool = True
    down_until: float = 0.0
    inflight: dict[str, _Flight] = field(default_factory=dict)
    version: int | None = None
    """The version it holds, as far as the router knows (None: unknown, not admitted)."""
    expected: int | None = None
    """The version last loaded into it (None: none yet; whatever it reports is taken)."""
    loading: bool = False
    probe: asyncio.Task[None] | None = None
    busy_s: float = 0.0
    """∫ calls in flight dt up to ``booked``: the slot-seconds its calls held (``occupancy``)."""
    booked: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.client = EngineClient(self.url)

    def book(self) -> float:
        """Close the busy integral up to now (before ``inflight`` changes); returns it."""
        now = time.monotonic()
        self.busy_s += (now - self.booked) * len(self.inflight)
        self.booked = now
        return self.busy_s

    def available(self, now: float) -> bool:
        return (
            self.admitting
            and not self.loading
            and self.version is not None
            and now >= self.down_until
            and len(self.inflight) < self.limit
        )


@dataclass(kw_only=True)
class Completion:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any] | None
    engine: str
    weight_version: str
    cached_tokens: int
    rerouted: bool
    t_start: float
    t_end: float
    segments: list[tuple[int, int]] = field(default_factory=list)
    """(output tokens, the version that generated them) for each part, in order."""
    routes: np.ndarray | None = None
    """A MoE model's routed experts [positions, layers, top-k] of positions ``RouteAsk.start``
    on: each position's from the first part that forwarded it."""


@dataclass(frozen=True)
class RouteAsk:
    """Routes a call asks its engines for: positions from ``start``, [layers, top_k] each."""

    start: int
    layers: int
    top_k: int


PROBE_S = 0.5
"""How often an engine of unknown version is asked which it holds."""


class Router:
    def __init__(
        self, engines: list[EngineSlot], timeout_s: float = 900.0, retry_down_s: float = 2.0
    ) -> None:
        self.engines = {e.url: e for e in engines}
        self.timeout_s = timeout_s
        self.retry_down_s = retry_down_s
        self.sticky: dict[str, str] = {}
        self._changed = asyncio.Condition()
        self._ids = itertools.count()

    async def close(self) -> None:
        for e in self.engines.values():
            if e.probe is not None:
                e.probe.cancel()
            await e.client.close()

    # ---- versions -------------------------------------------------------------------------------

    async def hold(self, url: str) -> int:
        """Before a load into ``url``: no new call, and its calls stop where they are (each goes
        on from its partial output after the load, or elsewhere); returns how many stopped."""
        slot = self.engines[url]
        slot.loading = True
        return await self._stop(slot, "continue")  # the tokens so far are exact, tagged with their version

    async def loaded(self, url: str, version: int) -> None:
        """``url`` holds ``version`` now, and may be admitted again."""
        slot = self.engines[url]
        slot.version = slot.expected = version
        slot.loading = False
        await self._notify()

    def _unsure(self, slot: EngineSlot) -> None:
        """It failed: it may be a fresh server with its initial weights. Not admitted until it
        reports the version last loaded into it (or a newer one)."""
        slot.version = None
        if slot.probe is None or slot.probe.done():
            slot.probe = asyncio.ensure_future(self._probe(slot))

    async def _probe(self, slot: EngineSlot) -> None:
        while slot.version is None:
            try:
                said = str((await slot.client.model_info()).get("weight_version"))
                held: int | None = int(said) if said.isdigit() else 0  # unnamed: the initial weights
            except (EngineError, aiohttp.ClientError, TimeoutError, ValueError):
                held = None
            if held is not None and (slot.expected is None or held >= slot.expected):
                if slot.version is None and not slot.loading:
                    slot.version = held
                await self._notify()
                return
            await asyncio.sleep(PROBE_S)

    async def acquire(self, run_id: str, deadline: float) -> EngineSlot:
        for slot in self.engines.values():
            if slot.version is None and not slot.loading:
                self._unsure(slot)  # learn what it holds (a probe at a time)
        async with self._changed:
            while True:
                now = time.monotonic()
                slot = self._pick(run_id, now)
                if slot is not None:
                    self.sticky[run_id] = slot.url
                    return slot
                if now >= deadline:
                    raise NoEngine("no engine could take the call in time")
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(0.5, deadline - now))
                except TimeoutError:
                    pass

    def _pick(self, run_id: str, now: float) -> EngineSlot | None:
        sticky = self.engines.get(self.sticky.get(run_id, ""))
        if sticky is not None and sticky.available(now):
            return sticky
        ready = [e for e in self.engines.values() if e.available(now)]
        return max(ready, key=lambda e: (e.rank, -len(e.inflight) / e.limit), default=None)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def complete(
        self, run_id: str, input_ids: list[int], params: dict[str, Any], routes: RouteAsk | None = None
    ) -> Completion:
        """Generate for one call, through any number of drains and engine failures; with
        ``routes``, collect the routed experts its parts report."""
        deadline = time.monotonic() + self.timeout_s
        started = time.time()
        output: list[int] = []
        logprobs: list[float] = []
        segments: list[tuple[int, int]] = []
        rerouted, cached, moved_kv = False, None, None
        got: list[np.ndarray] = []  # routes of positions routes.start … in order
        budget = int(params.get("max_new_tokens", 128))
        while True:
            slot = await self.acquire(run_id, deadline)
            flight = _Flight(f"{run_id}-{next(self._ids)}-{uuid.uuid4().hex[:6]}")
            slot.book()
            slot.inflight[flight.rid] = flight
            version = slot.version
            try:
                if moved_kv is not None:
                    await self._import_kv(slot, *moved_kv)
                    moved_kv = None
                left = dict(params, max_new_tokens=budget - len(output))
                start = None if routes is None else routes.start + sum(len(r) for r in got)
                res = await slot.client.generate(
                    input_ids + output, left, rid=flight.rid, extra_key=f"v{version}", routes_from=start
                )
                part = (
                    None if routes is None else routed_experts(res["meta_info"], routes.layers, routes.top_k)
                )
            except (EngineError, aiohttp.ClientError, TimeoutError) as err:
                if isinstance(err, EngineError) and err.refused:  # never the engine's fault:
                    raise Refused(_reason(err)) from None  # the client hears it at once
                slot.down_until = time.monotonic() + self.retry_down_s  # try the others first
                self._unsure(slot)
                output, logprobs, segments, rerouted, got = [], [], [], True, []
                if time.monotonic() >= deadline:
                    raise NoEngine(f"engine {slot.url} failed and no other served in time") from None
                continue
            except asyncio.CancelledError:  # the client went away: the engine stops too
                await _abort(slot, flight.rid)
                raise
            finally:
                slot.book()
                slot.inflight.pop(flight.rid, None)
                await self._notify()
            meta = res["meta_info"]
            cached = meta.get("cached_tokens", 0) if cached is None else cached
            served = str(meta.get("weight_version"))
            finished = flight.drained is None or meta["finish_reason"].get("type") != "abort"
            if finished or flight.drained == "continue":
                output += res["output_ids"]
                logprobs += [lp for lp, _, _ in meta["output_token_logprobs"]]
                segments = _segment(segments, len(res["output_ids"]), served, version)
                if part is not None:
                    got.append(part)
            if finished or (flight.drained == "continue" and len(output) >= budget):
                reason = meta["finish_reason"] if finished else {"type": "length", "length": len(output)}
                return Completion(
                    output_ids=output,
                    logprobs=logprobs,
                    finish_reason=reason,
                    engine=slot.url,
                    weight_version=served,
                    cached_tokens=cached,
                    rerouted=rerouted or not finished,
                    t_start=started,
                    t_end=time.time(),
                    segments=segments,
                    routes=None
                    if routes is None
                    else np.concatenate(got or [np.zeros((0, routes.layers, routes.top_k), np.int32)]),
                )
            rerouted = True
            if flight.drained == "continue":
                if flight.kv_handle:
                    moved_kv = (slot, flight.kv_handle, flight.kv_version)
            else:
                output, logprobs, segments, got = [], [], [], []

    def occupancy(self) -> dict[str, float]:
        """Each engine's busy slot-seconds so far (∫ calls in flight dt; a cell's slots are busy
        for the share of them its calls held)."""
        return {url: slot.book() for url, slot in self.engines.items()}

    async def drain(self, url: str, mode: DrainMode = "continue") -> int:
        """Stop admitting on ``url`` and move its in-flight calls elsewhere; returns how many."""
        slot = self.engines[url]
        slot.admitting = False
        return await self._stop(slot, mode)

    async def _stop(self, slot: EngineSlot, mode: DrainMode) -> int:
        """Abort every call in flight on ``slot``; each goes on as ``mode`` says (``continue``:
        from its partial output, its KV offered to an engine of the same version)."""
        flights = list(slot.inflight.values())
        for f in flights:
            f.drained = mode
            if mode == "continue":
                try:
                    f.kv_handle, f.kv_version = await slot.client.export_kv(f.rid), slot.version
                except (EngineError, aiohttp.ClientError, TimeoutError):
                    f.kv_handle = None  # it cannot export (or died): the destination recomputes
            await _abort(slot, f.rid)  # a dead engine's calls fail over by themselves
        await self._notify()
        return len(flights)

    async def undrain(self, url: str) -> None:
        self.engines[url].admitting = True
        await self._notify()

    async def _import_kv(
        self, dest: EngineSlot, source: EngineSlot, handle: str, version: int | None
    ) -> None:
        """The KV goes only to an engine of the version that computed it."""
        try:
            if version is not None and dest.version == version:
                await dest.client.import_kv(source.url, handle, extra_key=f"v{version}")
        except EngineError:
            pass  # no prefix moved: the destination recomputes it
        finally:
            try:
                await source.client.release_kv(handle)
            except (EngineError, aiohttp.ClientError):
                pass


def _segment(
    segments: list[tuple[int, int]], tokens: int, served: str, version: int | None
) -> list[tuple[int, int]]:
    """The call's segments with the part just served appended (parts of one version merge):
    the version the engine reported, else the one the router knew it held."""
    v = int(served) if served.isdigit() else (version or 0)
    if segments and segments[-1][1] == v:
        return [*segments[:-1], (segments[-1][0] + tokens, v)]
    return [*segments, (tokens, v)] if tokens or not segments else segments


def _reason(err: EngineError) -> str:
    """The engine's own message where it gave one in the usual JSON shape."""
    text = str(err).split(": ", 2)[-1]
    try:
        error = json.loads(text).get("error", {})
        return str(error.get("message", text)) if isinstance(error, dict) else text
    except (json.JSONDecodeError, AttributeError):
        return text


async def _abort(slot: EngineSlot, rid: str) -> None:
    try:
        await asyncio.shield(slot.client.abort(rid))
    except (aiohttp.ClientError, EngineError, TimeoutError, asyncio.CancelledError):
        pass
