"""A client of the SGLang-native HTTP API: the same verbs against SGLang or the embedded engine.

One method per verb, so a role switch reads as a sequence of them: ``pause`` → ``release_memory``
… ``resume_memory`` → ``update_weights_from_disk`` → ``continue_``.
"""

from __future__ import annotations

import base64
import inspect
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np


class EngineError(RuntimeError):
    """The engine answered with an error status (``status``; 0 when the request never got one)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        """The engine refused the request itself (4xx): asking another engine will not help."""
        return 400 <= self.status < 500


Sent = Callable[[str], object]
"""Called with a request's path once the request is sent, before its reply (awaited if it returns
an awaitable): a fault point — a test kills the server there, so that it dies while that verb is
in flight."""


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, sent: Sent | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.sent = sent
        """The fault point; it may be set at any time."""

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            trace = aiohttp.TraceConfig()
            trace.on_request_headers_sent.append(self._on_sent)
            self._session = aiohttp.ClientSession(timeout=self._timeout, trace_configs=[trace])
        return self._session

    async def _on_sent(self, session: object, context: object, params: Any) -> None:
        if self.sent is not None and inspect.isawaitable(done := self.sent(params.url.path)):
            await done

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        async with self._open().post(self.base_url + path, json=body or {}) as resp:
            if resp.status >= 400:
                raise EngineError(f"{path}: HTTP {resp.status}: {await resp.text()}", resp.status)
            if resp.content_type == "application/json":
                return await resp.json()
            return await resp.text()

    async def _get(self, path: str) -> Any:
        async with self._open().get(self.base_url + path) as resp:
            if resp.status >= 400:
                raise EngineError(f"{path}: HTTP {resp.status}: {await resp.text()}", resp.status)
            return await resp.json() if resp.content_type == "application/json" else await resp.text()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        extra_key: str | None = None,
        routes_from: int | None = None,
    ) -> dict[str, Any]:
        """``extra_key``: the request's prefix-cache key (it reuses only prefixes of its key).
        ``routes_from``: a MoE model's routed experts of positions from there on are returned
        (``routed_experts``, read with ``routed_experts``)."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if extra_key is not None:
            body["extra_key"] = extra_key
        if routes_from is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routes_from
        return await self._post("/generate", body)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._post("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def continue_(self) -> None:
        await self._post("/continue_generation")

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def health(self) -> bool:
        try:
            await self._get("/health")
            return True
        except (aiohttp.ClientError, EngineError, TimeoutError):
            return False

    async def health_generate(self) -> None:
        await self._get("/health_generate")

    async def model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str, flush_cache: bool = True, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        return await self._post(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
            },
        )

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self._post("/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", {"tags": tags} if tags else {})

    async def begin_weight_update(self) -> None:
        await self._post("/begin_weight_update", {"selector": "all"})

    async def end_weight_update(self) -> None:
        await self._post("/end_weight_update", {})

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        """Join the server's ranks to a process group with an outside rank 0 (the cell leader)."""
        return await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Receive the tensors rank 0 broadcasts over ``group_name`` as one flattened bucket
        (``flush_cache``: drop the prefix cache after it; the last bucket of a version does)."""
        return await self._post(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "weight_version": weight_version,
                "load_format": "flattened_bucket",
                "flush_cache": flush_cache,
            },
        )

    async def update_weights_from_tensor(
        self,
        serialized: list[str],
        weight_version: str,
        flush_cache: bool = True,
        load_format: str = "flattened_bucket",
    ) -> dict[str, Any]:
        """Load tensors the server's TP ranks read where they lie (``serialized``: one pickled
        reference per TP rank, base64: a CUDA IPC handle or a shared-memory file): a flattened
        bucket, or what a custom loader the server trusts takes (``load_format``: its path)."""
        return await self._post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized,
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            },
        )

    async def export_kv(self, rid: str) -> str | None:
        """Pin an in-flight request's KV for another engine; its handle (None: cannot export)."""
        return (await self._post("/export_kv", {"rid": rid})).get("handle")

    async def import_kv(self, source: str, handle: str, extra_key: str = "") -> None:
        await self._post("/import_kv", {"source": source, "handle": handle, "extra_key": extra_key})

    async def release_kv(self, handle: str) -> None:
        await self._post("/release_kv", {"handle": handle})


def routed_experts(meta_info: dict[str, Any], layers: int, top_k: int) -> np.ndarray | None:
    """A response's routed experts [positions, layers, top-k] (SGLang's base64 of int32); None
    when it carries none. A payload of another shape is the engine's fault, not the caller's."""
    data = meta_info.get("routed_experts")
    if not data:
        return None
    flat = np.frombuffer(base64.b64decode(data), dtype="<i4")
    if layers * top_k == 0 or flat.size % (layers * top_k):
        raise EngineError(f"routed_experts of {flat.size} ids is not [positions, {layers}, {top_k}]", 502)
    return flat.reshape(-1, layers, top_k)
