"""The proxy's edges, tried as a careless or hostile client would: every bad request gets a 4xx
with a one-line reason and nothing slows or hangs, an engine's refusal is the client's error, a
prompt that cannot fit is refused at once, and a restarted proxy still extends ids exactly."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loopback import TOOLS, Stack

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.server import make_app
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.proxy.router import EngineSlot, Refused, Router
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.tree import TrajectoryTree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


async def post(
    session: aiohttp.ClientSession, url: str, key: str | None, body: Any, raw: bytes | None = None
):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body).encode()
    started = time.monotonic()
    async with session.post(url, data=data, headers=headers) as resp:
        return resp.status, await resp.text(), time.monotonic() - started


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD: dict[str, list[Any]] = {
    "not a JSON object": [b"[1, 2]", b"{", b"\xff\xfe", b"null"],
    "messages of the wrong shape": [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": 7}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": {"id": "x"}}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 1}}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
        {"messages": [{"role": "tool", "tool_call_id": 9, "content": "x"}]},
    ],
    "tools of the wrong shape": [
        {**GOOD, "tools": {"type": "function"}},
        {**GOOD, "tools": ["run_shell"]},
        {**GOOD, "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        {**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
    ],
    "sampling out of range or of the wrong type": [
        {**GOOD, "temperature": -1},
        {**GOOD, "temperature": "hot"},
        {**GOOD, "top_p": 1.5},
        {**GOOD, "top_p": 0},
        {**GOOD, "seed": "x"},
        {**GOOD, "seed": 1.5},
        {**GOOD, "stop": 5},
        {**GOOD, "stop": ["ok", 1]},
        {**GOOD, "max_tokens": 0},
        {**GOOD, "max_tokens": True},
        {**GOOD, "n": 3},
        {**GOOD, "stream": "yes"},
    ],
}
TOKEN_BAD = [
    {"input_ids": []},
    {"input_ids": "1 2 3"},
    {"input_ids": [1, "2"]},
    {"input_ids": [1, 2, 10**9]},
    {"input_ids": [-1]},
    {"input_ids": [1, 2], "sampling_params": "fast"},
    {"input_ids": [1, 2], "sampling_params": {"temperature": "x"}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}},
]


def test_every_kind_of_bad_request_gets_a_one_line_4xx_at_once(tiny: Path, tmp_path: Path) -> None:
    async def go() -> tuple[dict[str, list[tuple[int, float]]], int]:
        async with Stack(tiny, tmp_path) as stack, aiohttp.ClientSession() as session:
            key, chat, tokens = (
                stack.key("r1"),
                stack.url + "/v1/chat/completions",
                stack.url + "/v1/generate",
            )
            seen: dict[str, list[tuple[int, float]]] = {}
            for category, bodies in BAD.items():
                for body in bodies:
                    raw = body if isinstance(body, bytes) else None
                    status, text, seconds = await post(session, chat, key, body, raw)
                    message = json.loads(text)["error"]["message"]
                    assert "\n" not in message and message, (body, text)
                    seen.setdefault(category, []).append((status, seconds))
            for body in TOKEN_BAD:
                status, text, seconds = await post(session, tokens, key, body)
                seen.setdefault("token endpoint", []).append((status, seconds))
            for header in ("Bearer gy-\u00e9\u00e9.x", "Bearer gy-abc", "Basic xyz", ""):
                async with session.post(chat, json=GOOD, headers={"Authorization": header}) as resp:
                    seen.setdefault("bad keys", []).append((resp.status, 0.0))
            status, _, _ = await post(session, chat, key, GOOD)
            return seen, status

    seen, after = asyncio.run(go())
    for category, results in seen.items():
        expected = 401 if category == "bad keys" else 400
        assert {s for s, _ in results} == {expected}, (category, results)
        assert max(t for _, t in results) < 2.0, category  # refused before anything was queued
    assert after == 200  # and the proxy still serves


def test_an_engine_s_refusal_is_the_client_s_error_and_never_takes_the_engine_down(tiny: Path) -> None:
    async def go() -> tuple[float, float, dict]:
        engine = Engine(tiny).start()
        runner = web.AppRunner(make_app(engine))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        router = Router([EngineSlot(url, 4)], timeout_s=60)
        try:
            started = time.monotonic()
            with pytest.raises(Refused, match="temperature"):
                await router.complete("r", [1, 2, 3], {"temperature": -1})  # the proxy would refuse first
            refused_in = time.monotonic() - started
            down = router.engines[url].down_until
            ok = await router.complete("r", [1, 2, 3], {"max_new_tokens": 2})
            return refused_in, down, {"tokens": ok.output_ids}
        finally:
            await router.close()
            await runner.cleanup()
            engine.stop()

    refused_in, down, ok = asyncio.run(go())
    assert refused_in < 1.0 and down == 0.0 and len(ok["tokens"]) == 2


def test_a_prompt_that_cannot_fit_is_refused_at_once_by_the_proxy_and_by_the_engine(
    tiny: Path, tmp_path: Path
) -> None:
    huge = "word " * 1_200_000  # ~1.2 M tokens against a 32K context; 6 MB
    long_ids = [10 + i % 500 for i in range(40_000)]

    async def go() -> list[tuple[int, str, float]]:
        async with Stack(tiny, tmp_path) as stack, aiohttp.ClientSession() as session:
            key = stack.key("r2")
            chat = await post(
                session,
                stack.url + "/v1/chat/completions",
                key,
                {"messages": [{"role": "user", "content": huge}]},
            )
            near = await post(
                session, stack.url + "/v1/chat/completions", key, {**GOOD, "max_tokens": 40_000}
            )
            tokens = await post(session, stack.url + "/v1/generate", key, {"input_ids": long_ids})
            engine = await post(session, stack.urls[0] + "/generate", None, {"input_ids": long_ids})
            assert not stack.engines[0].waiting and not stack.engines[0].running  # nothing was admitted
            return [chat, near, tokens, engine]

    resident = resident_mb()
    for status, text, seconds in asyncio.run(go()):
        assert status == 400 and "context of 32768 tokens" in text, text
        assert seconds < 1.0, seconds
    assert resident_mb() - resident < 200  # refused before any cache was grown (it once reached 11 GB)


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def test_a_client_that_leaves_stops_its_call_on_the_engine(tiny: Path, tmp_path: Path) -> None:
    async def go() -> tuple[int, int]:
        async with Stack(tiny, tmp_path) as stack:
            engine = stack.engines[0]
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 20_000, "ignore_eos": True}}
            timeout = aiohttp.ClientTimeout(total=1.0)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                with pytest.raises(TimeoutError):
                    await post(session, stack.url + "/v1/generate", stack.key("leaver"), body)
            running_then = len(engine.running)
            for _ in range(200):  # the proxy sees the disconnect and aborts the engine's request
                if not engine.running and not engine.waiting:
                    break
                await asyncio.sleep(0.05)
            return running_then, len(engine.running) + len(engine.waiting)

    _, left = asyncio.run(go())
    assert left == 0


def test_a_restarted_proxy_extends_a_running_conversation_s_ids_exactly(
    tool_model: Path, tmp_path: Path
) -> None:
    """Stop the proxy in the middle of a tool-calling conversation, start a new one on the same run
    directory: the next call's input still begins with the last call's exact input and output
    ids, tool-call arguments are restored, and call ids stay unique."""
    import openai

    messages: list[dict] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Go."},
    ]

    async def turns(n: int, seed: int) -> None:
        async with Stack(tool_model, tmp_path) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.key("run-r"))
            for turn in range(n):
                resp = await client.chat.completions.create(
                    model="anything",
                    messages=messages,
                    tools=TOOLS,
                    max_tokens=40,
                    temperature=0.2,
                    seed=seed + turn,
                )
                msg = resp.choices[0].message
                sent: dict = {"role": "assistant", "content": msg.content}
                if msg.tool_calls:  # reformatted, as harnesses do
                    sent["tool_calls"] = [
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {"name": tc.function.name, "arguments": spaced},
                        }
                        for tc in msg.tool_calls
                        if (spaced := json.dumps(json.loads(tc.function.arguments), indent=3))
                    ]
                messages.append(sent)
                for tc in msg.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": f"ran {turn}"})
                if not msg.tool_calls:
                    messages.append({"role": "user", "content": f"Continue {turn}."})
            await client.close()

    asyncio.run(turns(3, 0))
    asyncio.run(turns(3, 100))  # a new proxy process's state, from the run directory alone
    runs = dict(by_run(read_records(RunDir(tmp_path).tito_log).records))
    records = list(TrajectoryTree.from_encoded(runs["run-r"]).records())
    assert [r.call_id for r in records] == [f"call_{i}" for i in range(1, 7)]
    for prev, cur in zip(records, records[1:], strict=False):
        head = np.concatenate([prev.input_ids, prev.output_ids])
        assert np.array_equal(cur.input_ids[: len(head)], head), f"{cur.call_id} re-tokenised its history"


def test_keys_name_runs_and_roles_never_paths(tmp_path: Path) -> None:
    keys = KeyRing.load(RunDir(tmp_path).proxy_secret)
    for run, role in (
        ("../etc", "main"),
        ("a/b", "main"),
        ("ok", "main/../x"),
        (".hidden", "main"),
        ("", "main"),
    ):
        with pytest.raises(ValueError, match="is not valid"):
            keys.mint(run, role)
    assert keys.verify(keys.mint("s0001-task_3.g0", "sub-agent-summary")) == (
        "s0001-task_3.g0",
        "sub-agent-summary",
    )


def test_accepted_on_purpose_any_model_name_and_an_orphan_tool_call_id(tiny: Path, tmp_path: Path) -> None:
    body = {
        "model": "gpt-4o",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "tool", "tool_call_id": "call_never_served", "content": "output"},
        ],
        "max_tokens": 3,
    }

    async def go() -> tuple[int, str]:
        async with Stack(tiny, tmp_path) as stack, aiohttp.ClientSession() as session:
            status, text, _ = await post(session, stack.url + "/v1/chat/completions", stack.key("r3"), body)
            return status, text

    status, text = asyncio.run(go())
    assert status == 200 and json.loads(text)["model"] == tiny.name  # the policy served, named


# ---- fuzzing ------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ["messages", "tools", "temperature", "top_p", "seed", "stop", "max_tokens", "n", "stream", "model"]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "x"])},
    optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON},
)
BODY = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, optional={f: JSON for f in FIELDS[2:]}
    ),
)


@pytest.fixture(scope="module")
def fuzz_stack(tiny: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One proxy (and engine) on its own loop thread for every generated body."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stack = Stack(tiny, tmp_path_factory.mktemp("fuzz"))
    asyncio.run_coroutine_threadsafe(stack.__aenter__(), loop).result(60)
    try:
        yield stack, loop
    finally:
        asyncio.run_coroutine_threadsafe(stack.__aexit__(None, None, None), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY)
def test_no_generated_body_gets_a_5xx_or_hangs(fuzz_stack, body: Any) -> None:  # noqa: ANN001
    stack, loop = fuzz_stack

    async def go() -> tuple[int, str, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            if isinstance(body, dict) and (
                "max_tokens" not in body or isinstance(body["max_tokens"], int) and body["max_tokens"] > 2
            ):
                body["max_tokens"] = 2  # a valid body is served briefly (a long reply is no hang)
            return await post(session, stack.url + "/v1/chat/completions", stack.key("fuzz"), body)

    status, text, seconds = asyncio.run_coroutine_threadsafe(go(), loop).result(60)
    assert status < 500, (body, text)
    assert status in (200, 400), (status, text)


def test_the_proxy_still_serves_after_the_fuzzing(fuzz_stack) -> None:  # noqa: ANN001
    stack, loop = fuzz_stack

    async def go() -> int:
        async with aiohttp.ClientSession() as session:
            status, _, _ = await post(session, stack.url + "/v1/chat/completions", stack.key("after"), GOOD)
            return status

    assert asyncio.run_coroutine_threadsafe(go(), loop).result(60) == 200


# ---- every API shape, hostile ------------------------------------------------------------------

DEEP = b"[" * 10_000 + b"]" * 10_000
DEEP_ARGS = json.dumps({"a": 1}).replace("1", "[" * 10_000 + "]" * 10_000)
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
HOSTILE: list[tuple[str, Any, int]] = [
    # (endpoint, body, status): unauthenticated first, then bodies no parser should choke on
    (RESPONSES, {}, 401),
    (MESSAGES, {}, 401),
    ("/v1/chat/completions", DEEP, 400),
    (RESPONSES, DEEP, 400),
    (MESSAGES, DEEP, 400),
    (MESSAGES, {"max_tokens": 4, "messages": [{"role": "user"}]}, 400),  # a turn without content
    (MESSAGES, {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    (
        MESSAGES,
        {"max_tokens": 4, "system": [{"type": "text"}], "messages": [{"role": "user", "content": "x"}]},
        400,
    ),
    (
        MESSAGES,
        {"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use"}]}]},
        400,
    ),
    (RESPONSES, {"input": [{"type": "function_call"}]}, 400),
    (RESPONSES, {"input": [{"type": "web_search_call"}]}, 400),
    (RESPONSES, {"input": "x", "instructions": {"a": 1}}, 400),
    (RESPONSES, {"input": "x", "tools": [{"type": "function"}]}, 400),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": json.loads("{" + '"a":{' * 80 + "}" * 81)},
                }
            ],
        },
        400,
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "x" * 5000: 1}, 400),
]


def test_hostile_bodies_of_every_api_shape_get_a_4xx_and_authentication_comes_first(
    tiny: Path, tmp_path: Path
) -> None:
    async def go() -> list[tuple[int, str]]:
        async with Stack(tiny, tmp_path) as stack, aiohttp.ClientSession() as session:
            out = []
            for path, body, expected in HOSTILE:
                key = None if expected == 401 else stack.key("hostile")
                raw = body if isinstance(body, bytes) else None
                status, text, _ = await post(session, stack.url + path, key, body, raw)
                out.append((status, text))
            # A tool call's arguments nested past any parser are only text: served, not a 5xx.
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGS}}
            body = {"max_tokens": 2, "messages": [
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}  # fmt: skip
            status, text, _ = await post(
                session, stack.url + "/v1/chat/completions", stack.key("hostile"), body
            )
            out.append((status, text))
            return out

    results = asyncio.run(go())
    for (path, body, expected), (status, text) in zip(HOSTILE, results, strict=False):
        assert status == expected, (path, str(body)[:100], status, text)
        assert "\n" not in json.loads(text)["error"]["message"]
    assert results[-1][0] == 200, results[-1]


def test_a_ten_megabyte_field_is_refused_at_once_and_other_clients_go_on(tiny: Path, tmp_path: Path) -> None:
    """10 MB in a tool description, a function call's arguments, instructions or a system block
    (past the message-content pre-check they once slipped by) is refused in under a second, and a
    normal call made meanwhile is served as fast as without it."""
    huge = "word " * (2 << 20)
    hi = [{"role": "user", "content": "hi"}]
    attacks = [
        ("/v1/chat/completions",
         {**GOOD, "tools": [{"type": "function", "function": {"name": "f", "description": huge}}]}),
        (RESPONSES, {"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": huge}],
                     "max_output_tokens": 4}),
        (RESPONSES, {"input": "hi", "instructions": huge, "max_output_tokens": 4}),
        (MESSAGES, {"max_tokens": 4, "system": [{"type": "text", "text": huge}], "messages": hi}),
        (MESSAGES, {"max_tokens": 4, "messages": hi, "tools": [{"name": "f", "description": huge}]}),
    ]  # fmt: skip

    async def go() -> tuple[list[float], list[tuple[int, float]], list[float]]:
        async with Stack(tiny, tmp_path) as stack, aiohttp.ClientSession() as session:
            chat, key = stack.url + "/v1/chat/completions", stack.key("normal")
            alone = [(await post(session, chat, key, GOOD))[2] for _ in range(3)]
            hostile = [post(session, stack.url + path, stack.key("big"), body) for path, body in attacks]
            normal = [post(session, chat, key, GOOD) for _ in range(3)]
            done = await asyncio.gather(*hostile, *normal)
            refused = [(status, seconds) for status, _, seconds in done[: len(attacks)]]
            during = [seconds for status, _, seconds in done[len(attacks) :] if status == 200]
            return alone, refused, during

    alone, refused, during = asyncio.run(go())
    assert [s for s, _ in refused] == [400] * len(attacks)
    assert max(t for _, t in refused) < 1.0, refused
    assert len(during) == 3 and max(during) < max(alone) + 1.0, (alone, during)


TEXT_OR_JUNK = st.one_of(st.text(max_size=12), JSON)
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "x"])},
                          optional={"content": st.one_of(TEXT_OR_JUNK, st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["input_text", "output_text", "text", "x"])},
                              optional={"text": TEXT_OR_JUNK}), max_size=3))}),
    st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={"name": TEXT_OR_JUNK, "call_id": TEXT_OR_JUNK, "arguments": TEXT_OR_JUNK},
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output")},
                          optional={"call_id": TEXT_OR_JUNK, "output": TEXT_OR_JUNK}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call", "x"])}),
    JSON,
)  # fmt: skip
RESPONSES_BODY = st.fixed_dictionaries(
    {"input": st.one_of(st.text(max_size=12), st.lists(RESPONSES_ITEM, max_size=4), JSON)},
    optional={"instructions": TEXT_OR_JUNK, "tools": JSON, "temperature": JSON, "top_p": JSON,
              "stream": st.one_of(st.booleans(), JSON), "previous_response_id": JSON,
              "max_output_tokens": st.one_of(st.integers(-2, 2), JSON)},
)  # fmt: skip
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text")}, optional={"text": TEXT_OR_JUNK}),
    st.fixed_dictionaries({"type": st.just("tool_use")},
                          optional={"id": TEXT_OR_JUNK, "name": TEXT_OR_JUNK, "input": JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result")},
                          optional={"tool_use_id": TEXT_OR_JUNK, "content": JSON}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking", "x"])}),
    JSON,
)  # fmt: skip
MESSAGES_BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "x"])},
        optional={"content": st.one_of(st.text(max_size=12), st.lists(BLOCK, max_size=3), JSON)}),
        max_size=3), JSON)},
    optional={"system": st.one_of(st.text(max_size=12), st.lists(BLOCK, max_size=2), JSON),
              "max_tokens": st.one_of(st.integers(-2, 2), JSON), "tools": JSON,
              "stop_sequences": JSON, "temperature": JSON, "stream": st.one_of(st.booleans(), JSON)},
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from([RESPONSES, MESSAGES]), data=st.data())
def test_no_generated_responses_or_messages_body_gets_a_5xx(
    fuzz_stack, shape: str, data: st.DataObject
) -> None:  # noqa: ANN001
    stack, loop = fuzz_stack
    body = data.draw(RESPONSES_BODY if shape == RESPONSES else MESSAGES_BODY)

    async def go() -> tuple[int, str, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await post(session, stack.url + shape, stack.key("fuzz"), body)

    status, text, seconds = asyncio.run_coroutine_threadsafe(go(), loop).result(60)
    assert status in (200, 400), (shape, body, status, text)
