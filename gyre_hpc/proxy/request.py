"""What the proxy accepts from a client, checked before anything is queued or tokenised.

Every field the proxy reads is checked for type and range; the first one that is wrong makes a
400 whose one-line message names the field and what is valid. Fields the proxy does not use are
ignored, as OpenAI-compatible servers do. Accepted on purpose, and documented here:

- any ``model`` name: the API key fixes the run and the proxy serves one policy, whose name the
  reply carries; black-box harnesses often hard-code a model name;
- a tool message whose ``tool_call_id`` matches no earlier tool call: harnesses rewrite history
  (compaction, retries); it is rendered as given, and only tool-call payloads whose ids the proxy
  served are restored to the model's exact text.

This module knows nothing about tokenisation, engines or runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyre_hpc.engines.sampling import BadRequest, SamplingParams

ROLES = ("system", "user", "assistant", "tool")
MAX_DEPTH = 64
"""JSON nested deeper than this is refused (tool schemas need a handful of levels)."""
MAX_KEY = 1024
"""The longest object key accepted, in characters."""


class BadChat(BadRequest):
    """A request that does not fit the API (HTTP 400)."""


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    """Checked, with text content parts joined into one string."""
    tools: list[dict[str, Any]] | None
    params: dict[str, Any]
    """Sampling parameters as the engines take them (SGLang's names)."""
    stream: bool

    @property
    def max_new_tokens(self) -> int:
        return SamplingParams.from_request(self.params).max_new_tokens


def bounded(body: Any, max_chars: int, context: int) -> int:
    """The characters of text in ``body`` (every string value), checked before anything reads it
    further: nesting at most ``MAX_DEPTH`` deep, keys at most ``MAX_KEY`` characters, and no more
    text than a prompt that fits the model's ``context`` could hold (``max_chars``) — whichever field it is in
    (message content, tool descriptions and schemas, tool-call arguments, instructions, system
    blocks). Iterative: no body can make it recurse."""
    chars, stack = 0, [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            chars += len(node)
            if chars > max_chars:
                raise BadChat(
                    f"the request holds more than {max_chars:,} characters of text (whatever the field): "
                    f"more than a prompt that fits the model's context of {context} tokens can"
                )
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise BadChat(f"the request is nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            if long := next((k for k in node if len(k) > MAX_KEY), None):
                raise BadChat(f"an object key of {len(long):,} characters (at most {MAX_KEY})")
            stack.extend((v, depth + 1) for v in node.values())
        else:
            stack.extend((v, depth + 1) for v in node)
    return chars


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """``POST /v1/chat/completions``."""
    return ChatRequest(
        check_messages(body.get("messages")),
        check_tools(body.get("tools")),
        sampling(body),
        _flag(body, "stream"),
    )


def token_request(body: dict[str, Any], vocab_size: int) -> tuple[list[int], dict[str, Any]]:
    """``POST /v1/generate``: token ids (in the vocabulary) and SGLang sampling parameters."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(_int(t) for t in ids):
        raise BadChat("input_ids must be a non-empty list of token ids")
    if bad := next((t for t in ids if not 0 <= t < vocab_size), None):
        raise BadChat(f"input_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadChat("sampling_params must be an object")
    SamplingParams.from_request(params)  # types and ranges, the engines' own rules
    return ids, params


def check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadChat("messages must be a non-empty list")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise BadChat(f"{where} needs a role of {', '.join(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: text only
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type", "text") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise BadChat(f"{where}.content[{j}] must be a text part ({{'type': 'text', 'text': '…'}})")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise BadChat(f"{where}.content must be a string or a list of text parts")
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise BadChat(f"{where}.{key} must be a string")
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadChat(f"{where}.tool_calls must be a list")
        for j, tc in enumerate(calls):
            _tool_call(tc, f"{where}.tool_calls[{j}]")
    return {**m, "content": content or ""}


def _tool_call(tc: Any, where: str) -> None:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadChat(f"{where} needs function.name")
    if tc.get("id") is not None and not isinstance(tc["id"], str):
        raise BadChat(f"{where}.id must be a string")
    if not isinstance(fn.get("arguments", ""), str | dict):
        raise BadChat(f"{where}.function.arguments must be a JSON string (or an object)")


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadChat("tools must be a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or t.get("type", "function") != "function"
        ):
            raise BadChat(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': …}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadChat(f"tools[{i}].function.parameters must be an object")
    return tools


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's sampling fields, checked, under SGLang's names."""
    params: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("sampling_seed", "seed")):
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if not _int(max_tokens) or max_tokens < 1:
            raise BadChat(f"max_tokens = {max_tokens!r} must be a positive integer")
        params["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadChat("stop must be a string or a list of strings")
        params["stop"] = stop
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise BadChat("n must be 1 (one execution, one trajectory)")
    try:
        SamplingParams.from_request(params)
    except BadRequest as err:  # name the fields as the client sent them
        raise BadChat(str(err).replace("sampling_params.", "").replace("sampling_seed", "seed")) from None
    return params


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadChat(f"{key} must be true or false")
    return value
