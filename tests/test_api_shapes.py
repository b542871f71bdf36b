"""Every API shape at the proxy keeps the exactness guarantees of chat completions: the official
clients, multi-turn, tool calls sent back re-serialised, streaming (proxy.messages,
proxy.responses)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from loopback import TOOLS, Stack

from gyre_hpc.rundir import RunDir
from gyre_hpc.trajectory.codec import by_run, read_records
from gyre_hpc.trajectory.tree import TrajectoryTree

ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip


def one_exact_path(run_dir: Path, run: str, calls: int) -> None:
    records = list(
        TrajectoryTree.from_encoded(
            dict(by_run(read_records(RunDir(run_dir).tito_log).records))[run]
        ).records()
    )
    assert len(records) == calls
    for prev, cur in zip(records, records[1:], strict=False):
        head = np.concatenate([prev.input_ids, prev.output_ids])
        assert np.array_equal(cur.input_ids[: len(head)], head), f"call {cur.call_id} re-tokenised history"
    assert len(TrajectoryTree.from_records(records).leaves()) == 1


def reserialise(value: dict) -> dict:
    """What a client does to a tool call's input: a fresh object, keys in another order."""
    return json.loads(json.dumps(dict(reversed(list(value.items())))))


def test_anthropic_client_12_turns_with_tool_use_keeps_exact_ids(tool_model: Path, tmp_path: Path) -> None:
    async def go() -> int:
        async with Stack(tool_model, tmp_path) as stack:
            client = anthropic.AsyncAnthropic(
                base_url=stack.proxy_url, api_key=stack.key("run-a"), max_retries=0
            )
            messages: list[dict] = [{"role": "user", "content": "Fix the failing test."}]
            uses = 0
            for turn in range(12):
                msg = await client.messages.create(
                    model="tiny", system="You are an agent.", messages=messages, tools=ANTHROPIC_TOOLS,
                    max_tokens=40, extra_body={"temperature": 0.2},  # this client has no temperature argument
                )  # fmt: skip
                blocks = [b.model_dump() for b in msg.content]
                for b in blocks:
                    if b["type"] == "tool_use":
                        b["input"] = reserialise(b["input"])
                messages.append({"role": "assistant", "content": blocks})
                results = [
                    {"type": "tool_result", "tool_use_id": b["id"], "content": f"ran ({turn})"}
                    for b in blocks if b["type"] == "tool_use"
                ]  # fmt: skip
                uses += len(results)
                assert (msg.stop_reason == "tool_use") == bool(results)
                messages.append({"role": "user", "content": results or f"Continue ({turn})."})
            await client.close()
            return uses

    assert asyncio.run(go()) >= 5  # tool calls really went back, re-serialised
    one_exact_path(tmp_path, "run-a", 12)


def test_anthropic_streaming_returns_the_same_message(tool_model: Path, tmp_path: Path) -> None:
    async def go() -> tuple[list, list]:
        async with Stack(tool_model, tmp_path) as stack:
            client = anthropic.AsyncAnthropic(
                base_url=stack.proxy_url, api_key=stack.key("run-s"), max_retries=0
            )
            go_on = [{"role": "user", "content": "Go."}]
            kwargs = {
                "model": "tiny",
                "messages": go_on,
                "tools": ANTHROPIC_TOOLS,
                "max_tokens": 30,
                "extra_body": {"temperature": 0},
            }
            async with client.messages.stream(**kwargs) as stream:
                streamed = await stream.get_final_message()
            whole = await client.messages.create(**kwargs)
            await client.close()
            strip = lambda m: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]  # noqa: E731
            return strip(streamed), strip(whole)

    streamed, whole = asyncio.run(go())
    assert streamed == whole and streamed


def test_anthropic_errors_are_one_line_in_the_api_error_shape(tool_model: Path, tmp_path: Path) -> None:
    async def go() -> list[str]:
        async with Stack(tool_model, tmp_path) as stack:
            client = anthropic.AsyncAnthropic(
                base_url=stack.proxy_url, api_key=stack.key("run-e"), max_retries=0
            )
            out = []
            for messages in (
                [],
                [{"role": "robot", "content": "x"}],
                [{"role": "user", "content": [{"type": "image"}]}],
            ):
                try:
                    await client.messages.create(model="tiny", messages=messages, max_tokens=8)
                except anthropic.BadRequestError as err:
                    out.append(err.message)
            bad = anthropic.AsyncAnthropic(base_url=stack.proxy_url, api_key="nope", max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(
                    model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8
                )
            await client.close()
            await bad.close()
            return out

    errors = asyncio.run(go())
    assert len(errors) == 3 and "messages must be a non-empty list" in errors[0]
    assert "needs a role of user, assistant" in errors[1] and "only text and tool_result" in errors[2]


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_openai_responses_12_turns_with_function_calls_keeps_exact_ids(
    tool_model: Path, tmp_path: Path
) -> None:
    async def go() -> int:
        async with Stack(tool_model, tmp_path) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.key("run-r"), max_retries=0)
            items: list[dict] = [{"role": "user", "content": "Fix the failing test."}]
            calls = 0
            for turn in range(12):
                resp = await client.responses.create(
                    model="tiny", instructions="You are an agent.", input=items, tools=RESPONSES_TOOLS,
                    max_output_tokens=40, temperature=0.2,
                )  # fmt: skip
                for item in resp.output:  # sent back as the client has them, arguments re-serialised
                    sent = item.model_dump(exclude_none=True)
                    if sent["type"] == "function_call":
                        sent["arguments"] = json.dumps(json.loads(sent["arguments"]), indent=1)
                        items.append(sent)
                        items.append(
                            {
                                "type": "function_call_output",
                                "call_id": sent["call_id"],
                                "output": f"ran ({turn})",
                            }
                        )
                        calls += 1
                    else:
                        items.append(sent)
                if not any(i.type == "function_call" for i in resp.output):
                    items.append({"role": "user", "content": f"Continue ({turn})."})
            await client.close()
            return calls

    assert asyncio.run(go()) >= 5
    one_exact_path(tmp_path, "run-r", 12)


def summary(response: openai.types.responses.Response) -> list[tuple]:
    return [
        ("text", i.content[0].text) if i.type == "message" else (i.type, i.name, i.arguments)
        for i in response.output
    ]


def test_openai_responses_streaming_returns_the_same_output(tool_model: Path, tmp_path: Path) -> None:
    async def go() -> tuple[list, list]:
        async with Stack(tool_model, tmp_path) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.key("run-t"), max_retries=0)
            kwargs = {
                "model": "tiny",
                "input": "Go.",
                "tools": RESPONSES_TOOLS,
                "max_output_tokens": 30,
                "temperature": 0,
            }
            async with client.responses.stream(**kwargs) as stream:
                streamed = await stream.get_final_response()
            whole = await client.responses.create(**kwargs)
            await client.close()
            return summary(streamed), summary(whole)

    streamed, whole = asyncio.run(go())
    assert streamed == whole and streamed


def test_responses_refuses_state_it_does_not_keep(tool_model: Path, tmp_path: Path) -> None:
    async def go() -> str:
        async with Stack(tool_model, tmp_path) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.key("run-p"), max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                await client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
            await client.close()
            return err.value.message

    assert "previous_response_id is not supported" in asyncio.run(go())
