"""The proxy's HTTP front: OpenAI chat completions, the OpenAI Responses and Anthropic Messages
APIs (mapped onto chat completions: ``proxy.responses``, ``proxy.messages``), and a token-level
endpoint.

```
 harness ──POST /v1/chat/completions (Bearer <run key>)──▶ key → (run, role)
   messages ─▶ RunChats.input_ids (exact ids reused, only new text tokenised)
            ─▶ Router.complete (sticky / least loaded / drains)  ─▶ engine /generate
            ─▶ TitoLog.append (group commit: on disk before the reply)
   ◀── assistant message with tool_calls parsed from the model's <tool_call> blocks
```

``POST /v1/generate`` is the same for harnesses that work in token ids. Every endpoint checks
the key before it reads the body, and bounds the body (nesting, key length, the text any field
holds) before anything else reads it (``request.bounded``). Errors are JSON in the OpenAI error
shape with a one-line reason: 400 a request that does not fit the API (``proxy.request``), a
prompt that does not fit the model's context, or one an engine refused; 401 unknown key; 413
body over the limit; 503 no engine in time. A client's input never makes a 5xx. Each served
chat call is also noted in the run directory's chat index, so a restarted proxy still extends a
running conversation's exact ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from aiohttp import web

from gyre_hpc.diskspace import write_all
from gyre_hpc.engines.client import EngineClient
from gyre_hpc.engines.sampling import BadRequest, SamplingParams
from gyre_hpc.engines.server import read_json_object
from gyre_hpc.errors import GyreError
from gyre_hpc.faults.points import FaultPoints
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.observability.events import open_log
from gyre_hpc.proxy import messages as anthropic_messages
from gyre_hpc.proxy import responses as openai_responses
from gyre_hpc.proxy.chat import RunChats, parse_reply
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.proxy.request import BadChat, bounded, chat_request, token_request
from gyre_hpc.proxy.router import EngineSlot, NoEngine, RouteAsk, Router
from gyre_hpc.proxy.run_shard import shard_of
from gyre_hpc.proxy.tito_log import TitoLog
from gyre_hpc.recipe.schema import ProxyConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.records import CallMeta, TitoRecord, as_routes

PROXY = web.AppKey("proxy", object)
log = logging.getLogger(__name__)
OVERHEAD_HEADER = "X-Gyre-Proxy-Ms"
LARGE_BODY = 256 << 10
"""Requests larger than this are tokenised off the event loop, so they never stall other runs."""


class Proxy:
    def __init__(
        self,
        run_dir: str | Path,
        model_dir: str | Path,
        engines: list[str],
        config: ProxyConfig,
        capacity: int = 8,
        limits: Mapping[str, int] | None = None,
        worker: int = 0,
        workers: int = 1,
        routes: bool = True,
    ) -> None:
        """``capacity``: calls in flight an engine admits, unless ``limits`` says per engine URL
        (``proxy.admission_limit`` overrides both). As ``worker`` of ``workers`` (``proxy.worker``)
        it serves only the runs of its shard (``run_shard``), into its own TITO segment.
        ``routes``: record a mixture-of-experts model's routed experts (``trainer.routing_replay``
        replays them); a dense model has none."""
        self.run_dir = Path(run_dir)
        self.config = config
        self.tokenizer = ChatTokenizer(model_dir)
        self.model_name = Path(model_dir).name
        model = ModelConfig.load(model_dir)  # the engines serve this model
        self.context, self.vocab_size = model.max_position_embeddings, model.vocab_size
        self.experts = model.num_experts
        self.route_shape = (
            (model.num_hidden_layers, model.num_experts_per_tok) if routes and model.num_experts else None
        )
        """[layers, top-k] of the routes each call records; None: none recorded."""
        self.max_chars = self.context * self.tokenizer.max_token_chars
        """The most text a prompt that fits the context can hold: any more is refused unread."""
        files = RunDir(self.run_dir)
        self.keys = KeyRing.load(files.proxy_secret)
        self.worker, self.workers = worker, workers
        self.faults = FaultPoints()
        """Where a test makes this process die (``GYRE_FAULT``, set by ``proxy.worker``)."""
        self.tito = TitoLog(files.tito_segment(worker))
        self.index = ChatIndex(files.chat_index_segment(worker))
        admits = admission_limits(config, engines, capacity, limits or {})
        self.router = Router(
            [EngineSlot(url, admits[url], rank=i) for i, url in enumerate(engines)],
            timeout_s=config.request_timeout_s,
        )
        self.runs: dict[str, RunChats] = {}
        self._calls: dict[str, int] = {}
        self.eos = {self.tokenizer.token_id("<|im_end|>"), self.tokenizer.token_id("<|endoftext|>")}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_mb << 20, middlewares=[_errors])
        app[PROXY] = self
        app.router.add_post("/v1/chat/completions", chat_completions)
        app.router.add_post("/v1/messages", mapped_api(anthropic_messages))
        app.router.add_post("/v1/responses", mapped_api(openai_responses))
        app.router.add_post("/v1/generate", generate_tokens)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        await self.router.close()
        self.tito.close()
        self.index.close()

    def authorize(self, request: web.Request) -> tuple[str, str]:
        auth = request.headers.get("Authorization", "")
        # OpenAI clients send a bearer token, Anthropic clients an x-api-key header.
        key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
        who = self.keys.verify(key) if key else None
        if who is None:
            raise web.HTTPUnauthorized(
                text=_error(
                    "missing or unknown API key; mint one with "
                    "`gyre-hpc proxy key RUN_DIR --run ID --role ROLE`",
                    401,
                ),
                content_type="application/json",
            )
        owner = shard_of(who[0], self.workers)
        if owner != self.worker:  # its records belong in its own worker's segment
            raise web.HTTPMisdirectedRequest(
                text=_error(f"run {who[0]!r} is served by proxy worker {owner}, not {self.worker}", 421),
                content_type="application/json",
            )
        return who

    def chats(self, run_id: str) -> RunChats:
        if run_id not in self.runs:
            chats = RunChats(self.tokenizer, self.tito.tree(run_id))
            for entry in self.index.entries.pop(run_id, []):  # what a proxy before us served
                chats.remember(entry)
            self.runs[run_id] = chats
        return self.runs[run_id]

    def usage(self, run_id: str) -> tuple[int, int]:
        """Calls recorded for ``run_id``, and the tokens they processed (input + output)."""
        tree = self.tito.trees.get(run_id)
        if tree is None:
            return 0, 0
        records = [tree.record(i) for i in range(tree.num_records)]
        return len(records), sum(len(r.input_ids) + len(r.output_ids) for r in records)

    def next_call_id(self, run_id: str) -> str:
        """``call_<n>``, unique in the run across proxy restarts (counting on from its log)."""
        if run_id not in self._calls:
            numbers = (
                r.call_id[5:] for r in self.tito.tree(run_id).records() if r.call_id.startswith("call_")
            )
            self._calls[run_id] = max((int(n) for n in numbers if n.isdigit()), default=0)
        self._calls[run_id] += 1
        return f"call_{self._calls[run_id]}"

    def check_context(self, prompt: int, max_new_tokens: int, at_least: bool = False) -> None:
        if prompt + max_new_tokens > self.context:
            raise BadChat(
                f"a prompt of {'at least ' if at_least else ''}{prompt} tokens + max_tokens {max_new_tokens} "
                f"does not fit the model's context of {self.context} tokens"
            )

    async def call(
        self, run_id: str, role: str, call_id: str, input_ids: list[int], params: dict[str, Any]
    ) -> tuple[TitoRecord, int, int, float]:
        """Serve one model call and make it durable: (record, index, cached tokens, seconds in engines)."""
        started = time.perf_counter()
        ask = None
        if self.route_shape is not None:  # only positions the run's tree has no route for yet
            ask = RouteAsk(self.tito.tree(run_id).routes_from(np.asarray(input_ids)), *self.route_shape)
        done = await self.router.complete(run_id, input_ids, params, ask)
        self.faults.reach("proxy")
        engine_s = time.perf_counter() - started
        version = done.weight_version
        meta = CallMeta(
            # the version of its first part: the oldest (a call spans loads only forward)
            policy_version=done.segments[0][1] if done.segments else int(version) if version.isdigit() else 0,
            engine=done.engine,
            t_start=done.t_start,
            t_end=done.t_end,
            rerouted=done.rerouted,
            aborted=(done.finish_reason or {}).get("type") == "abort",
            finish_reason=(done.finish_reason or {}).get("type", ""),
            segments=tuple(done.segments) if len(done.segments) > 1 else (),
            cached_tokens=done.cached_tokens,
        )
        routes = None
        if done.routes is not None:
            try:
                routes = as_routes(done.routes, self.experts)
            except ValueError as err:  # the engine's fault: the call is kept, its routes are not
                log.warning("run %s %s: %s; recorded without them", run_id, call_id, err)
        record = TitoRecord(
            run_id,
            call_id,
            role,
            input_ids,
            done.output_ids,
            done.logprobs,
            meta,
            routes,
            0 if ask is None else ask.start,
        )
        index = await self.tito.append(record)
        return record, index, done.cached_tokens, engine_s


def serve(proxy: Proxy, host: str, port: int) -> None:
    """Serve ``proxy`` until interrupted, on a faster event loop where one is installed: the proxy
    is on every model call's path."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = None
    web.run_app(proxy.app(), host=host, port=port, print=None, loop=loop, handler_cancellation=True)


def model_of(engine: str) -> Path:
    """The model directory an engine serves (its tokenizer and chat template are the proxy's)."""

    async def ask() -> str:
        async with EngineClient(engine, timeout_s=10) as client:
            return (await client.model_info())["tokenizer_path"]

    try:
        return Path(asyncio.run(ask()))
    except Exception as err:  # noqa: BLE001 - any failure to ask is the user's to fix
        raise GyreError(f"cannot ask {engine} for its model ({err}); pass --model DIR") from None


def admission_limits(
    config: ProxyConfig, engines: Iterable[str], capacity: int, limits: Mapping[str, int]
) -> dict[str, int]:
    """Calls in flight each engine admits: ``proxy.admission_limit`` if set, else its own limit,
    else ``capacity``."""
    return {url: config.admission_limit or limits.get(url, capacity) for url in engines}


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as err:  # malformed JSON, or a chat that does not fit the API
        return web.Response(text=_error(str(err), 400), status=400, content_type="application/json")
    except NoEngine as err:
        return web.Response(text=_error(str(err), 503), status=503, content_type="application/json")


def _error(message: str, code: int) -> str:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if code < 500 else "server_error",
                "code": code,
            }
        }
    )


@dataclass(frozen=True)
class ChatReply:
    """One served chat call, whatever API shape it came in and goes back in."""

    call_id: str
    message: dict[str, Any]
    """The assistant message: ``content`` and, when the model called tools, ``tool_calls``."""
    finish: str
    """stop | length | tool_calls"""
    usage: dict[str, Any]
    headers: dict[str, str]
    stream: bool
    model: str


@dataclass(frozen=True)
class Body:
    """A request's JSON body, from a client that proved who it is, checked for shape and size."""

    who: tuple[str, str]
    """(run, role), from its key."""
    json: dict[str, Any]
    chars: int
    """Characters of text in it (``request.bounded``)."""
    entered: float


async def read_body(request: web.Request) -> Body:
    """Authenticate, then parse: a client without a key learns nothing of what a body may hold
    (401 whatever it sent). The body is then bounded before anything else reads it; a large one is
    parsed off the event loop, so other runs' calls go on meanwhile."""
    entered = time.perf_counter()
    proxy: Proxy = request.app[PROXY]  # type: ignore[assignment]
    who = proxy.authorize(request)
    if (request.content_length or 0) > LARGE_BODY:
        raw = await request.read()
        body, chars = await asyncio.to_thread(_parse, raw, proxy.max_chars, proxy.context)
    else:
        body = await read_json_object(request)
        chars = bounded(body, proxy.max_chars, proxy.context)
    return Body(who, body, chars, entered)


def _parse(raw: bytes, max_chars: int, context: int) -> tuple[dict[str, Any], int]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"request body is not JSON (or nested too deeply): {str(err)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body, bounded(body, max_chars, context)


async def serve_chat(request: web.Request, b: Body, body: dict[str, Any]) -> ChatReply:
    """A chat-completions ``body`` (what every API shape is mapped onto), served exactly: the
    run's recorded ids reused, only new text tokenised, the call durable before the reply."""
    entered = b.entered
    proxy: Proxy = request.app[PROXY]  # type: ignore[assignment]
    run_id, role = b.who
    req = chat_request(body)
    # Far too long is refused before tokenising: no token is longer than max_token_chars.
    proxy.check_context(b.chars // proxy.tokenizer.max_token_chars, req.max_new_tokens, at_least=True)
    chats = proxy.chats(run_id)
    if (request.content_length or 0) > LARGE_BODY:
        input_ids = await asyncio.to_thread(chats.input_ids, req.messages, req.tools)
    else:
        input_ids = chats.input_ids(req.messages, req.tools)
    proxy.check_context(len(input_ids), req.max_new_tokens)
    messages, tools, params = req.messages, req.tools, req.params
    call_id = proxy.next_call_id(run_id)
    record, index, cached, engine_s = await proxy.call(run_id, role, call_id, input_ids, params)
    output = record.output_ids.tolist()
    content, tool_calls = parse_reply(proxy.tokenizer.decode(output), f"{call_id}")
    closed = bool(output) and output[-1] in proxy.eos
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        reply["tool_calls"] = tool_calls
    proxy.index.append(run_id, chats.record(messages, tools, index, reply, closed))
    finish = "tool_calls" if tool_calls else ("length" if record.meta.finish_reason == "length" else "stop")
    usage = {
        "prompt_tokens": len(input_ids),
        "completion_tokens": len(output),
        "total_tokens": len(input_ids) + len(output),
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    # The proxy's own time for this call (everything but waiting for engines), for dashboards and benches.
    headers = {OVERHEAD_HEADER: f"{(time.perf_counter() - entered - engine_s) * 1000:.3f}"}
    return ChatReply(call_id, reply, finish, usage, headers, req.stream, proxy.model_name)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    b = await read_body(request)
    r = await serve_chat(request, b, b.json)
    message = {**r.message, "content": r.message["content"] or (None if "tool_calls" in r.message else "")}
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    if not r.stream:
        return web.json_response(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": r.model,
                "usage": r.usage,
                "choices": [{"index": 0, "message": message, "finish_reason": r.finish}],
            },
            headers=r.headers,
        )
    return await _stream(request, cid, created, r.model, message, r.finish, r.usage)


def mapped_api(shape: ModuleType) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of an API ``shape`` mapped onto chat completions: ``proxy.messages`` (Anthropic
    Messages, ``/v1/messages``) or ``proxy.responses`` (OpenAI Responses, ``/v1/responses``)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        b = await read_body(request)
        r = await serve_chat(request, b, shape.to_chat(b.json))
        reply = shape.from_chat(r.message, r.finish, r.usage, r.model)
        if not r.stream:
            return web.json_response(reply, headers=r.headers)
        return await _events(request, shape.stream_events(reply))

    return handler


async def _events(request: web.Request, events: Iterable[tuple[str, dict[str, Any]]]) -> web.StreamResponse:
    """Server-sent events with names (the Messages and Responses APIs' streams)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for event, data in events:
        await resp.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
    return resp


async def _stream(
    request: web.Request,
    cid: str,
    created: int,
    model: str,
    message: dict[str, Any],
    finish: str,
    usage: dict[str, Any],
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def chunk(delta: dict[str, Any], reason: str | None = None, **extra: Any) -> None:
        data = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
            **extra,
        }
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())

    await chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        await chunk({"content": message["content"]})
    for i, tc in enumerate(message.get("tool_calls") or []):
        await chunk({"tool_calls": [{"index": i, **tc}]})
    await chunk({}, finish, usage=usage)
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def generate_tokens(request: web.Request) -> web.Response:
    proxy: Proxy = request.app[PROXY]  # type: ignore[assignment]
    b = await read_body(request)
    run_id, role = b.who
    ids, params = token_request(b.json, proxy.vocab_size)
    proxy.check_context(len(ids), SamplingParams.from_request(params).max_new_tokens)
    call_id = proxy.next_call_id(run_id)
    record, index, cached, _ = await proxy.call(run_id, role, call_id, ids, params)
    return web.json_response(
        {
            "call_id": call_id,
            "output_ids": record.output_ids.tolist(),
            "output_logprobs": record.output_logprobs.tolist(),
            "finish_reason": record.meta.finish_reason,
            "cached_tokens": cached,
            "weight_version": record.meta.policy_version,
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def models(request: web.Request) -> web.Response:
    proxy: Proxy = request.app[PROXY]  # type: ignore[assignment]
    return web.json_response({"object": "list", "data": [{"id": proxy.model_name, "object": "model"}]})


class ChatIndex:
    """The run directory's chat index: per served chat call, what ``RunChats.remember`` needs
    (transcript digest, record, tool-call arguments), one JSON line each, appended as the TITO
    log is. A restarted proxy reads it back; a torn last line is skipped."""

    def __init__(self, path: Path) -> None:
        self.entries: dict[str, list[dict[str, Any]]] = {}
        if path.exists():
            for line in path.read_bytes().splitlines():
                try:
                    entry = json.loads(line)
                    self.entries.setdefault(entry.pop("run"), []).append(entry)
                except (json.JSONDecodeError, AttributeError, KeyError):
                    continue
        self._fd = open_log(path)

    def append(self, run_id: str, entry: dict[str, Any]) -> None:
        write_all(self._fd, (json.dumps({"run": run_id, **entry}, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
