"""The Anthropic Messages API (``POST /v1/messages``) as the proxy serves it: each request is
mapped onto the chat-completions form the proxy renders exactly, and the reply mapped back.

```
 system (string or text blocks)          ─▶ {"role": "system"}
 user:      text blocks                  ─▶ {"role": "user", "content": text}
            tool_result blocks           ─▶ {"role": "tool", "tool_call_id": id, "content": text}
 assistant: text + tool_use blocks       ─▶ {"role": "assistant", "content": text,
                                              "tool_calls": [{id, function: {name, arguments}}]}
 tools [{name, description, input_schema}] ─▶ [{"type": "function", "function": {…, parameters}}]
 max_tokens, temperature, top_p, stop_sequences ─▶ the chat fields of the same meaning
```

A ``tool_use`` block the client sends back carries the id the proxy gave it, so the chat index
restores the model's exact text for it however the client re-serialised its ``input``; prefix
reuse and no re-tokenisation of the history then hold as for chat completions. Streaming sends
the finished reply as the API's event sequence. This module knows nothing about tokens or engines.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from gyre_hpc.proxy.request import BadChat

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body of a Messages API request (400 on what does not fit)."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadChat("messages must be a non-empty list")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise BadChat(f"{where} needs a role of user, assistant")
        if "content" not in turn:
            raise BadChat(f"{where} needs content (a string or a list of content blocks)")
        messages += (
            _assistant(turn["content"], where)
            if turn["role"] == "assistant"
            else _user(turn["content"], where)
        )
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    if body.get("max_tokens") is None:
        raise BadChat("max_tokens is required (a positive integer)")
    for key in ("max_tokens", "temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if tools := body.get("tools"):
        if not isinstance(tools, list):
            raise BadChat("tools must be a list")
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    return chat


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise BadChat(f"{where}.content must be a string or a list of content blocks")
    return content


def _text(content: Any, where: str) -> str:
    parts = []
    for j, b in enumerate(_blocks(content, where)):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise BadChat(f"{where}[{j}] must be a text block ({{'type': 'text', 'text': '…'}})")
        parts.append(b["text"])
    return "".join(parts)


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, b in enumerate(_blocks(content, where)):
        if b.get("type") == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise BadChat(f"{where}.content[{j}].tool_use_id must be a string")
            result = b.get("content", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b["tool_use_id"],
                    "content": _text(result, f"{where}.content[{j}].content") if result else "",
                }
            )
        elif b.get("type") == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        else:
            raise BadChat(
                f"{where}.content[{j}]: only text and tool_result blocks are accepted from the user"
            )
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(content: Any, where: str) -> list[dict[str, Any]]:
    text, calls = [], []
    for j, b in enumerate(_blocks(content, where)):
        if b.get("type") == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif b.get("type") == "tool_use" and isinstance(b.get("name"), str):
            args = b.get("input", {})
            calls.append(
                {
                    "id": b.get("id"),
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(args)},
                }
            )
        else:
            raise BadChat(
                f"{where}.content[{j}]: only text and tool_use blocks are accepted from the assistant"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool(t: Any, where: str) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise BadChat(f"{where} must be {{'name': …, 'input_schema': {{…}}}}")
    fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("input_schema", {})}
    return {"type": "function", "function": fn}


def from_chat(message: dict[str, Any], finish: str, usage: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages API reply for a served chat call."""
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for tc in message.get("tool_calls") or []:
        try:
            args = json.loads(tc["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = {}
        content.append(
            {
                "type": "tool_use",
                "id": tc["id"],
                "name": tc["function"]["name"],
                "input": args if isinstance(args, dict) else {"value": args},
            }
        )
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP.get(finish, "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        },
    }


def stream_events(reply: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Messages API's server-sent events for a finished reply."""
    start = {**reply, "content": [], "stop_reason": None, "usage": {**reply["usage"], "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    for i, block in enumerate(reply["content"]):
        if block["type"] == "text":
            yield (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
            )
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
            )
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": reply["usage"]["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}
