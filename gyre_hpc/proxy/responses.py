"""The OpenAI Responses API (``POST /v1/responses``) as the proxy serves it: each request is mapped
onto the chat-completions form the proxy renders exactly, and the reply mapped back.

```
 instructions                                ─▶ {"role": "system"}
 input: a string                             ─▶ {"role": "user"}
        {"role": r, "content": text | parts} ─▶ {"role": r} (developer → system)
        {"type": "function_call", …}         ─▶ the assistant message's tool_calls (by call_id)
        {"type": "function_call_output", …}  ─▶ {"role": "tool", "tool_call_id": call_id}
        {"type": "reasoning", …}             ─▶ dropped (the policy writes no separate reasoning)
 tools [{"type": "function", name, parameters}] ─▶ chat tools
 max_output_tokens, temperature, top_p       ─▶ the chat fields of the same meaning
```

The proxy keeps no conversation state (``previous_response_id`` is refused: send the whole
input); it needs none, as each run's chat index already reuses the recorded ids of whatever
history is re-sent. A ``function_call`` item sent back carries the ``call_id`` the proxy gave it,
so its exact text is restored however the client re-serialised the arguments. Streaming sends
the finished reply as the API's event sequence. This module knows nothing about tokens or engines.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from gyre_hpc.proxy.request import BadChat

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body of a Responses API request (400 on what does not fit)."""
    if body.get("previous_response_id"):
        raise BadChat("previous_response_id is not supported: the proxy keeps no state; send the whole input")
    messages: list[dict[str, Any]] = []
    if instructions := body.get("instructions"):
        if not isinstance(instructions, str):
            raise BadChat("instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadChat("input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        _item(item, f"input[{i}]", messages)
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if tools := body.get("tools"):
        if not isinstance(tools, list):
            raise BadChat("tools must be a list")
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    return chat


def _item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise BadChat(f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ROLES:
            raise BadChat(f"{where} needs a role of {', '.join(ROLES)}")
        messages.append(
            {"role": ROLES[item["role"]], "content": _text(item.get("content"), f"{where}.content")}
        )
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise BadChat(f"{where}: a function_call needs name and call_id")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")}}  # fmt: skip
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":  # calls after a reply's text join its message
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise BadChat(f"{where}: a function_call_output needs call_id")
        output = item.get("output", "")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    elif kind != "reasoning":
        raise BadChat(
            f"{where}: item type {kind!r} is not accepted (message, function_call, function_call_output)"
        )


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadChat(f"{where} must be a string or a list of text parts")
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            raise BadChat(f"{where}[{j}]: only text parts are accepted (input_text, output_text)")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


def _tool(t: Any, where: str) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise BadChat(f"{where} must be {{'type': 'function', 'name': …, 'parameters': {{…}}}}")
    fn = {
        "name": t["name"],
        "description": t.get("description") or "",
        "parameters": t.get("parameters") or {},
    }
    return {"type": "function", "function": fn}


def from_chat(message: dict[str, Any], finish: str, usage: dict[str, Any], model: str) -> dict[str, Any]:
    """The Responses API reply for a served chat call."""
    output: list[dict[str, Any]] = []
    if message.get("content"):
        text = {"type": "output_text", "text": message["content"], "annotations": []}
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                       "role": "assistant", "content": [text]})  # fmt: skip
    for tc in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": tc["id"],
                       "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
                       "status": "completed"})  # fmt: skip
    incomplete = finish == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def stream_events(reply: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Responses API's server-sent events for a finished reply."""
    n = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(n), **data}

    yield event("response.created", response={**reply, "status": "in_progress", "output": []})
    for i, item in enumerate(reply["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "content": []},
            )
            ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
            yield event("response.content_part.added", **ids, part={**part, "text": ""})
            yield event("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
        else:
            yield event(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            ids = {"item_id": item["id"], "output_index": i}
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    yield event(
        "response.completed" if reply["status"] == "completed" else "response.incomplete", response=reply
    )
