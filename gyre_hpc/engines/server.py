"""The embedded engine behind the SGLang-native HTTP API, on aiohttp.

Endpoints: ``/generate`` (token ids or text, single or batch, optional SSE streaming),
``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``,
``/health``, ``/health_generate``, ``/get_model_info``, ``/update_weights_from_disk``,
``/release_memory_occupation``, ``/resume_memory_occupation``, and the
``/begin_weight_update`` … ``/end_weight_update`` session SGLang 0.5.23 requires around tensor
updates. A malformed request gets HTTP 400 with the reason.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from gyre_hpc.engines.embedded import Engine, Sequence
from gyre_hpc.engines.kv_transfer import HttpKVTransfer, KVTransfer
from gyre_hpc.engines.sampling import BadRequest, SamplingParams

ENGINE = web.AppKey("engine", Engine)
STATE = web.AppKey("state", dict)
TRANSFER = web.AppKey("transfer", object)


def make_app(engine: Engine, transfer: KVTransfer | None = None) -> web.Application:
    app = web.Application(client_max_size=256 << 20, middlewares=[_errors])
    app[ENGINE] = engine
    app[STATE] = {"released": False, "weight_update_session": False}
    app[TRANSFER] = transfer or HttpKVTransfer()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/health_generate", health_generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/release_memory_occupation", release_memory)
    app.router.add_post("/resume_memory_occupation", resume_memory)
    app.router.add_post("/export_kv", export_kv)
    app.router.add_get("/kv/{handle}", kv_bytes)
    app.router.add_post("/import_kv", import_kv)
    app.router.add_post("/release_kv", release_kv)
    app.router.add_post("/begin_weight_update", begin_weight_update)
    app.router.add_post("/end_weight_update", end_weight_update)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as err:
        return web.json_response({"error": {"message": str(err), "code": 400}}, status=400)


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (empty when there is none), else ``BadRequest``."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as err:  # not JSON, or not UTF-8
        raise BadRequest(f"request body is not JSON: {err}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def generate(request: web.Request) -> web.StreamResponse:
    engine, body = request.app[ENGINE], await read_json_object(request)
    if request.app[STATE]["released"]:
        return web.json_response(
            {"error": {"message": "memory released; resume first", "code": 503}}, status=503
        )
    prompts = _prompts(engine, body)
    params = SamplingParams.from_request(body.get("sampling_params"))
    return_logprob = bool(body.get("return_logprob", False))
    if (body.get("logprob_start_len") or -1) >= 0 or (body.get("top_logprobs_num") or 0) > 0:
        raise BadRequest("input and top log-probs are not supported by the embedded engine")
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    jobs = [
        (ids, r if params.n == 1 else f"{r or 'req'}-{k}")
        for ids, r in zip(prompts, rids, strict=False)
        for k in range(params.n)
    ]
    if body.get("stream"):
        if len(jobs) != 1:
            raise BadRequest("streaming takes one prompt with n = 1")
        return await _stream(request, engine, jobs[0], params, return_logprob, _extra_key(body))
    routes_from = _routes_from(body)
    for ids, _ in jobs:  # every prompt refused or none: nothing half-submitted
        engine.check(ids, params)
        if routes_from is not None and routes_from > len(ids):
            raise BadRequest(f"routed_experts_start_len must be in [0, {len(ids)}]")
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[dict[str, Any]]] = []
    seqs: list[Sequence] = []
    for ids, r in jobs:
        fut = loop.create_future()
        done = _resolver(loop, fut)
        seqs.append(
            engine.submit(ids, params, done, rid=r, extra_key=_extra_key(body), routes_from=routes_from)
        )
        futures.append(fut)
    try:
        results = await asyncio.gather(*futures)
    except asyncio.CancelledError:  # the client went away: free the engine
        for s in seqs:
            engine.abort(s.rid)
        raise
    results = [_shape(r, return_logprob) for r in results]
    ids = body.get("input_ids")
    batch = bool(ids) and isinstance(ids[0], list) or isinstance(body.get("text"), list)
    return web.json_response(results if batch or params.n > 1 else results[0])


def _routes_from(body: dict[str, Any]) -> int | None:
    """SGLang's ``return_routed_experts`` and ``routed_experts_start_len``: the first position
    whose routed experts the response carries; None when not asked."""
    if not body.get("return_routed_experts"):
        return None
    start = body.get("routed_experts_start_len", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise BadRequest(f"routed_experts_start_len = {start!r} must be an integer ≥ 0")
    return start


def _extra_key(body: dict[str, Any]) -> str:
    """SGLang's per-request cache key: a prefix is reused only by requests of the same key."""
    key = body.get("extra_key")
    if key is not None and not isinstance(key, str):
        raise BadRequest("extra_key should be a string for a single request")
    return key or ""


def _prompts(engine: Engine, body: dict[str, Any]) -> list[list[int]]:
    if "input_ids" in body:
        ids = body["input_ids"]
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in batch):
            raise BadRequest("input_ids must be a non-empty list of token ids, or a list of such lists")
        return batch
    if "text" in body:
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        return [engine.tokenizer.encode(t) for t in texts]
    raise BadRequest("give input_ids (or text)")


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[dict[str, Any]]) -> Any:
    def done(result: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    return done


def _shape(result: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
    if not return_logprob:
        result = {
            **result,
            "meta_info": {k: v for k, v in result["meta_info"].items() if k != "output_token_logprobs"},
        }
    return result


async def _stream(
    request: web.Request,
    engine: Engine,
    job: tuple[list[int], str | None],
    params: SamplingParams,
    return_logprob: bool,
    extra_key: str,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def on_token(seq: Sequence) -> None:
        chunk = engine.response(seq)
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    def on_done(result: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, result)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    seq = engine.submit(job[0], params, on_done, rid=job[1], on_token=on_token, extra_key=extra_key)
    try:
        while (chunk := await queue.get()) is not None:
            await resp.write(f"data: {json.dumps(_shape(chunk, return_logprob))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        engine.abort(seq.rid)
        raise
    return resp


async def abort_request(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    n = request.app[ENGINE].abort(body.get("rid"), bool(body.get("abort_all", False)))
    return web.json_response({"success": True, "aborted": n})


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    request.app[ENGINE].pause(body.get("mode", "abort"))
    return web.json_response({"success": True})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[ENGINE].resume()
    return web.json_response({"success": True})


async def flush_cache(request: web.Request) -> web.Response:
    request.app[ENGINE].flush_cache()
    return web.json_response({"success": True})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[dict[str, Any]] = loop.create_future()
    engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0), _resolver(loop, fut), rid="health")
    await asyncio.wait_for(fut, timeout=30)
    return web.Response(text="")


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(
        {
            "model_path": str(engine.model_dir),
            "tokenizer_path": str(engine.model_dir),
            "is_generation": True,
            "weight_version": engine.weight_version,
            "vocab_size": engine.config.vocab_size,
        }
    )


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine, body = request.app[ENGINE], await read_json_object(request)
    if "model_path" not in body:
        raise BadRequest("model_path is required")
    if body.get("abort_all_requests"):
        engine.abort(abort_all=True)
    version = str(body.get("weight_version") or engine.weight_version)
    await asyncio.to_thread(engine.load_weights_from_disk, body["model_path"], version)
    return web.json_response({"success": True, "message": f"loaded {body['model_path']} as {version}"})


async def release_memory(request: web.Request) -> web.Response:
    request.app[STATE]["released"] = True  # on CPU nothing to give back; requests are refused meanwhile
    return web.json_response({"success": True})


async def resume_memory(request: web.Request) -> web.Response:
    request.app[STATE]["released"] = False
    return web.json_response({"success": True})


async def export_kv(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    got = request.app[ENGINE].export_kv(str(body.get("rid")))
    if got is None:
        raise BadRequest(f"no running request {body.get('rid')!r}")
    return web.json_response({"handle": got[0], "tokens": got[1]})


async def kv_bytes(request: web.Request) -> web.Response:
    data = request.app[ENGINE].pinned.get(request.match_info["handle"])
    if data is None:
        return web.json_response(
            {"error": {"message": "unknown or released handle", "code": 404}}, status=404
        )
    return web.Response(body=data, content_type="application/octet-stream")


async def import_kv(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    if not body.get("source") or not body.get("handle"):
        raise BadRequest("import_kv needs source and handle")
    data = await request.app[TRANSFER].fetch(body["source"], body["handle"])  # type: ignore[attr-defined]
    tokens = await asyncio.to_thread(request.app[ENGINE].import_kv, data, str(body.get("extra_key") or ""))
    return web.json_response({"success": True, "tokens": tokens})


async def release_kv(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    request.app[ENGINE].release_kv(str(body.get("handle")))
    return web.json_response({"success": True})


async def begin_weight_update(request: web.Request) -> web.Response:
    request.app[STATE]["weight_update_session"] = True
    return web.json_response({"success": True})


async def end_weight_update(request: web.Request) -> web.Response:
    request.app[STATE]["weight_update_session"] = False
    return web.json_response({"success": True})


def serve(engine: Engine, host: str, port: int) -> None:
    web.run_app(
        make_app(engine), host=host, port=port, print=None, handle_signals=True, handler_cancellation=True
    )
