"""The proxy over real HTTP: the official openai client, exact token ids, drains, keys, errors."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
import torch
from loopback import TOOLS, Stack

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.models.causal_lm import CausalLM
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.proxy.tito_log import TitoLog
from gyre_hpc.recipe.schema import ProxyConfig
from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.tree import TrajectoryTree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def records_of(run_dir: Path, run: str) -> list:
    runs = dict(by_run(read_records(RunDir(run_dir).tito_log).records))
    return list(TrajectoryTree.from_encoded(runs[run]).records())


def reformat(arguments: str) -> str:
    """What harnesses do to tool-call JSON: reorder keys, change spacing."""
    try:
        return json.dumps(json.loads(arguments), indent=2, sort_keys=True, separators=(" ,", " : "))
    except json.JSONDecodeError:
        return arguments + " "


def test_openai_client_20_turns_with_reformatted_tool_calls_keeps_exact_ids(
    tool_model: Path, tmp_path: Path
) -> None:
    async def go() -> int:
        async with Stack(tool_model, tmp_path) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.key("run-1"))
            messages: list[dict] = [
                {"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "Fix the failing test."},
            ]
            tool_calls = 0
            for turn in range(20):
                resp = await client.chat.completions.create(
                    model="tiny", messages=messages, tools=TOOLS, max_tokens=40, temperature=0.2, seed=turn
                )
                msg = resp.choices[0].message
                sent = {"role": "assistant", "content": msg.content}
                if msg.tool_calls:
                    sent["tool_calls"] = [
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {
                                "name": tc.function.name,
                                "arguments": reformat(tc.function.arguments),
                            },
                        }
                        for tc in reversed(msg.tool_calls)
                    ][::-1]
                messages.append(sent)
                for tc in msg.tool_calls or []:
                    tool_calls += 1
                    messages.append({"role": "tool", "tool_call_id": tc.id, "content": f"ran ({turn})"})
                if not msg.tool_calls:
                    messages.append({"role": "user", "content": f"Continue ({turn})."})
            await client.close()
            return tool_calls

    tool_calls = asyncio.run(go())
    assert tool_calls >= 5  # the harness really did reformat tool calls back
    records = records_of(tmp_path, "run-1")
    assert len(records) == 20
    for prev, cur in zip(records, records[1:], strict=False):
        head = np.concatenate([prev.input_ids, prev.output_ids])
        assert np.array_equal(cur.input_ids[: len(head)], head), f"call {cur.call_id} re-tokenised history"
    tree = TrajectoryTree.from_records(records)
    assert len(tree.leaves()) == 1  # one linear conversation: one path


def test_streaming_returns_the_same_message(tool_model: Path, tmp_path: Path) -> None:
    async def go() -> tuple[str, str]:
        async with Stack(tool_model, tmp_path) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.key("run-s"))
            messages = [{"role": "user", "content": "Go."}]
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, max_tokens=30, temperature=0, stream=True
            )
            parts, finish = [], None
            async for chunk in stream:
                delta = chunk.choices[0].delta
                parts.append(delta.content or "")
                for tc in delta.tool_calls or []:
                    parts.append(tc.function.name)
                finish = chunk.choices[0].finish_reason or finish
            whole = await client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, max_tokens=30, temperature=0
            )
            m = whole.choices[0].message
            await client.close()
            return "".join(parts), (m.content or "") + "".join(tc.function.name for tc in m.tool_calls or [])

    streamed, whole = asyncio.run(go())
    assert streamed == whole


def test_drain_continue_moves_kv_and_keeps_logprobs_aligned(tiny: Path, tmp_path: Path) -> None:
    async def go() -> tuple[dict, Stack]:
        async with Stack(tiny, tmp_path, n=2) as stack:
            key = stack.key("run-d")
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
                body = {
                    "input_ids": list(range(5, 205)),
                    "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 7},
                }
                task = asyncio.create_task(s.post(stack.url + "/v1/generate", json=body))
                while not any(e.running and len(e.running[0].output_ids) > 40 for e in stack.engines):
                    await asyncio.sleep(0.01)
                source = next(u for u, e in zip(stack.urls, stack.engines, strict=True) if e.running)
                moved = await stack.proxy.router.drain(source, "continue")
                resp = await task
                out = await resp.json()
            stats = [dict(e.stats) for e in stack.engines]
            return {"out": out, "moved": moved, "stats": stats, "source": stack.urls.index(source)}, stack

    got, _ = asyncio.run(go())
    out = got["out"]
    assert got["moved"] == 1 and len(out["output_ids"]) == 300 == len(out["output_logprobs"])
    dest = got["stats"][1 - got["source"]]
    assert dest["cached_tokens"] >= 200 + 40 - 1  # the destination recomputed no prefix
    (record,) = records_of(tmp_path, "run-d")
    assert record.meta.rerouted and record.output_ids.tolist() == out["output_ids"]
    model = CausalLM.from_pretrained(tiny)  # log-probs still belong to their tokens
    ids = torch.tensor([list(range(5, 205)) + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0][0, 199:-1], -1)
    expected = logp.gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    assert np.allclose(record.output_logprobs, expected.numpy(), atol=2e-4)


async def kill_engine(stack: Stack, i: int) -> None:
    """Engine ``i`` of ``stack`` as a killed process leaves it: every connection reset, none taken."""
    runner = stack.runners[i]
    for conn in list(runner.server.connections):
        if conn.transport is not None:
            conn.transport.abort()
    for site in list(runner.sites):
        await site.stop()


def test_a_call_whose_engine_dies_as_it_arrives_goes_on_elsewhere(tiny: Path, tmp_path: Path) -> None:
    """The engine a call is routed to dies the moment the call reaches it: the call is made on
    the other engine, to its end, and recorded once."""

    async def go() -> tuple[dict, list[str]]:
        async with Stack(tiny, tmp_path, n=2) as stack:
            killed: list[str] = []
            for i, url in enumerate(stack.urls):

                async def die(path: str, i: int = i, url: str = url) -> None:
                    if path == "/generate" and not killed:
                        killed.append(url)
                        await kill_engine(stack, i)

                stack.proxy.router.engines[url].client.sent = die
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {stack.key('run-g')}"}) as s:
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
                return await (await s.post(stack.url + "/v1/generate", json=body)).json(), killed

    out, killed = asyncio.run(go())
    assert len(killed) == 1 and len(out["output_ids"]) == 60
    (record,) = records_of(tmp_path, "run-g")
    assert record.meta.engine != killed[0] and record.output_ids.tolist() == out["output_ids"]


def test_a_call_whose_connection_to_its_engine_is_reset_mid_answer_goes_on_elsewhere(
    tiny: Path, tmp_path: Path
) -> None:
    """The connection between proxy and engine is reset while the engine is generating the
    call's answer (40 tokens in): the call is made on the other engine, to its end, and recorded
    once, from that engine."""

    async def go() -> tuple[dict, str]:
        async with Stack(tiny, tmp_path, n=2) as stack:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {stack.key('run-r')}"}) as s:
                body = {
                    "input_ids": [1, 2, 3],
                    "sampling_params": {"max_new_tokens": 120, "ignore_eos": True},
                }
                task = asyncio.create_task(s.post(stack.url + "/v1/generate", json=body))
                while not any(e.running and len(e.running[0].output_ids) > 40 for e in stack.engines):
                    await asyncio.sleep(0.01)
                i = next(i for i, e in enumerate(stack.engines) if e.running)
                await kill_engine(stack, i)
                return await (await task).json(), stack.urls[i]

    out, reset = asyncio.run(go())
    assert len(out["output_ids"]) == 120
    (record,) = records_of(tmp_path, "run-r")
    assert record.meta.engine != reset and record.output_ids.tolist() == out["output_ids"]


@pytest.mark.parametrize("dies_on", ["/export_kv", "/abort_request"])
def test_a_drain_whose_engine_dies_under_it_raises_nothing_and_the_call_goes_on(
    tiny: Path, tmp_path: Path, dies_on: str
) -> None:
    """The engine being drained dies the moment the drain's export (or abort) reaches it: the
    drain returns, and the call it had goes on elsewhere to its end (it raised before)."""

    async def go() -> tuple[dict, int]:
        async with Stack(tiny, tmp_path, n=2) as stack:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {stack.key('run-k')}"}) as s:
                params = {"max_new_tokens": 200, "ignore_eos": True}
                body = {"input_ids": [1, 2, 3], "sampling_params": params}
                task = asyncio.create_task(s.post(stack.url + "/v1/generate", json=body))
                while not any(e.running and len(e.running[0].output_ids) > 20 for e in stack.engines):
                    await asyncio.sleep(0.01)
                i = next(i for i, e in enumerate(stack.engines) if e.running)
                slot = stack.proxy.router.engines[stack.urls[i]]

                async def die(path: str) -> None:
                    if path == dies_on:
                        await kill_engine(stack, i)

                slot.client.sent = die
                moved = await stack.proxy.router.drain(stack.urls[i], "continue")
                return await (await task).json(), moved

    out, moved = asyncio.run(go())
    assert moved == 1 and len(out["output_ids"]) == 200
    (record,) = records_of(tmp_path, "run-k")
    assert record.meta.rerouted and record.output_ids.tolist() == out["output_ids"]


def test_drain_restart_reroutes_from_scratch(tiny: Path, tmp_path: Path) -> None:
    async def go() -> dict:
        async with Stack(tiny, tmp_path, n=2, config=ProxyConfig(drain_mode="restart")) as stack:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {stack.key('run-r')}"}) as s:
                body = {
                    "input_ids": [1, 2, 3],
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                }
                task = asyncio.create_task(s.post(stack.url + "/v1/generate", json=body))
                while not any(e.running and len(e.running[0].output_ids) > 20 for e in stack.engines):
                    await asyncio.sleep(0.01)
                source = next(u for u, e in zip(stack.urls, stack.engines, strict=True) if e.running)
                await stack.proxy.router.drain(source, "restart")
                return await (await task).json()

    out = asyncio.run(go())
    assert len(out["output_ids"]) == 200
    (record,) = records_of(tmp_path, "run-r")
    assert record.meta.rerouted


def test_kv_export_import_matches_recomputation(tiny: Path) -> None:
    import threading

    source, dest, fresh = Engine(tiny).start(), Engine(tiny).start(), Engine(tiny, cache_tokens=0).start()
    try:
        prompt = [10 + i % 800 for i in range(4096)]  # a 4K-token context
        seq = source.submit(
            prompt, SamplingParams(max_new_tokens=20_000, ignore_eos=True), lambda r: None, rid="moving"
        )
        while len(seq.output_ids) < 8:
            time.sleep(0.01)
        handle, n = source.export_kv("moving")
        source.abort("moving")
        assert dest.import_kv(source.pinned[handle]) == n
        source.release_kv(handle)
        tokens = seq.tokens[: n + 1]
        results: dict[str, dict] = {}
        done = threading.Event()
        for name, engine in (("migrated", dest), ("recomputed", fresh)):
            engine.submit(
                tokens,
                SamplingParams(max_new_tokens=4, temperature=0),
                lambda r, name=name: (results.__setitem__(name, r), len(results) == 2 and done.set()),
            )
        assert done.wait(60)
    finally:
        for e in (source, dest, fresh):
            e.stop()
    migrated, recomputed = results["migrated"]["meta_info"], results["recomputed"]["meta_info"]
    assert migrated["cached_tokens"] == n and recomputed["cached_tokens"] == 0
    a = [lp for lp, _, _ in migrated["output_token_logprobs"]]
    b = [lp for lp, _, _ in recomputed["output_token_logprobs"]]
    assert np.allclose(a, b, atol=1e-4)  # float32, 4K context: summation order differs only


def test_keys_errors_and_limits(tiny: Path, tmp_path: Path) -> None:
    async def go() -> dict[str, int]:
        config = ProxyConfig(max_body_mb=1, request_timeout_s=2)
        async with Stack(tiny, tmp_path, config=config) as stack:
            codes: dict[str, int] = {}
            good = {"Authorization": f"Bearer {stack.key('run-k')}"}
            forged = KeyRing(b"not the secret").mint("run-k", "main")
            async with aiohttp.ClientSession() as s:
                chat = stack.url + "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                codes["no key"] = (await s.post(chat, json=body)).status
                codes["forged"] = (
                    await s.post(chat, json=body, headers={"Authorization": f"Bearer {forged}"})
                ).status
                codes["bad json"] = (await s.post(chat, data=b"{", headers=good)).status
                codes["bad schema"] = (await s.post(chat, json={"messages": "hi"}, headers=good)).status
                codes["too big"] = (await s.post(chat, data=b"x" * (2 << 20), headers=good)).status
                codes["ok"] = (await s.post(chat, json=body, headers=good)).status
                await stack.proxy.router.drain(stack.urls[0], "restart")  # nothing left to serve
                codes["no engine"] = (await s.post(chat, json=body, headers=good)).status
            return codes

    codes = asyncio.run(go())
    assert codes == {
        "no key": 401,
        "forged": 401,
        "bad json": 400,
        "bad schema": 400,
        "too big": 413,
        "ok": 200,
        "no engine": 503,
    }


def test_tito_log_reopens_after_a_torn_tail(tiny: Path, tmp_path: Path) -> None:
    from gyre_hpc.trajectory import TitoRecord

    async def write(log: TitoLog, n: int) -> None:
        ctx = [1, 2]
        for i in range(n):
            await log.append(TitoRecord("r", f"c{i}", "main", ctx, [100 + i], [-1.0]))
            ctx = ctx + [100 + i, 50]

    log = TitoLog(tmp_path / "tito.bin")
    asyncio.run(write(log, 3))
    log.close()
    with (tmp_path / "tito.bin").open("ab") as fh:
        fh.write(b"GT\x10\x00")  # a frame cut short by a crash
    log = TitoLog(tmp_path / "tito.bin")
    assert log.trees["r"].num_records == 3
    log.close()
    assert read_records(tmp_path / "tito.bin").torn_bytes == 0


def test_routing_sticky_then_rank_then_load() -> None:
    from gyre_hpc.proxy.router import EngineSlot, Router

    async def go() -> list[str]:
        a, b, c = (
            EngineSlot("http://a", limit=2, rank=0, version=0),
            EngineSlot("http://b", limit=2, rank=2, version=0),
            EngineSlot("http://c", limit=2, rank=1, version=0),
        )
        router = Router([a, b, c])
        picks = []
        deadline = time.monotonic() + 1
        slot = await router.acquire("run-1", deadline)
        picks.append(slot.url)  # b: stays available longest
        b.inflight = {"x": None, "y": None}  # type: ignore[dict-item]  # b is full
        picks.append((await router.acquire("run-1", deadline)).url)  # sticky b is full: next rank, c
        picks.append((await router.acquire("run-1", deadline)).url)  # now sticky to c
        c.admitting = False  # c drains
        picks.append((await router.acquire("run-1", deadline)).url)  # only a is left
        a.inflight = {"z": None, "w": None}  # type: ignore[dict-item]
        try:
            await router.acquire("run-2", time.monotonic() + 0.2)
        except Exception as err:
            picks.append(type(err).__name__)
        await router.close()
        return picks

    assert asyncio.run(go()) == ["http://b", "http://c", "http://c", "http://a", "NoEngine"]


def test_a_dead_engine_is_routed_around(tiny: Path, tmp_path: Path) -> None:
    async def go() -> list[str]:
        async with Stack(tiny, tmp_path, n=2) as stack:
            await stack.runners[1].cleanup()  # engine 1 goes away (it has the highest rank: chosen first)
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {stack.key('run-x')}"}) as s:
                outs = []
                for _ in range(3):
                    resp = await s.post(
                        stack.url + "/v1/generate",
                        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
                    )
                    outs.append((resp.status, (await resp.json())["finish_reason"]))
            return outs

    assert asyncio.run(go()) == [(200, "length")] * 3


def test_proxy_key_cli_mints_keys_the_proxy_accepts(tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre_hpc",
            "proxy",
            "key",
            str(tmp_path),
            "--run",
            "t1",
            "--role",
            "sub-agent",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    assert KeyRing.load(RunDir(tmp_path).proxy_secret).verify(proc.stdout.strip()) == ("t1", "sub-agent")
    assert KeyRing.load(RunDir(tmp_path).proxy_secret).verify(proc.stdout.strip()[:-2] + "xx") is None
