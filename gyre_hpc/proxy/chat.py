"""Chat ↔ token ids with exactness: the proxy renders the template itself and never re-tokenises
what the model produced.

For each run the proxy keeps every call it served: the messages it was given, the exact input
and output ids, and the assistant message it returned. A new request is matched against them:

1. tool-call payloads are restored by call id (harnesses reorder JSON keys, change spacing);
2. the longest recorded transcript (messages + the assistant reply) that the request begins
   with is found, and its exact ids — input and the model's own output — are reused;
3. only the messages after it are rendered and tokenised, behind the template's closing
   of the assistant turn.

So in a linear conversation call k+1's input starts with call k's input + output ids exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.trajectory.tree import TrajectoryTree

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_reply(text: str, call_prefix: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a model reply; a block that is not valid JSON stays in the content."""
    calls, kept = [], []
    last = 0
    for n, m in enumerate(_TOOL_CALL.finditer(text)):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": f"{call_prefix}_{n}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    kept.append(text[last:])
    content = "".join(kept)
    for special in ("<|im_end|>", "<|endoftext|>"):
        content = content.replace(special, "")
    return content.strip(), calls


def message_key(m: Mapping[str, Any]) -> str:
    """A canonical form: what must agree for a message to count as the one recorded."""
    key = f"{m.get('role')}\x1f{(m.get('content') or '').strip()}\x1f{m.get('tool_call_id') or ''}"
    if m.get("tool_calls"):
        calls = [
            (tc.get("id"), tc["function"]["name"], _canonical_args(tc["function"].get("arguments")))
            for tc in m["tool_calls"]
        ]
        key += "\x1f" + json.dumps(calls, ensure_ascii=False, sort_keys=True)
    return key


def _canonical_args(a: Any) -> Any:
    try:
        return json.loads(a) if isinstance(a, str) else a
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past the parser
        return a


def prefix_digests(messages: Sequence[Mapping[str, Any]], tools_key: str) -> list[bytes]:
    """digest[i] identifies tools + messages[: i + 1], so transcripts compare in O(1)."""
    h = hashlib.sha256(tools_key.encode())
    out = []
    for m in messages:
        h.update(message_key(m).encode() + b"\x00")
        out.append(h.copy().digest())
    return out


@dataclass
class Served:
    """One call as served, by the digest of its transcript (its messages and the reply)."""

    record: int
    """Index of the call's TITO record in the run's trajectory tree (the exact ids live there)."""
    transcript_len: int
    closed: bool
    """The model's output ended the turn itself (its end-of-turn token is among the output ids)."""


@dataclass
class RunChats:
    """What one run was served, to rebuild each next request's ids exactly.

    Ids are not kept here: they are read back from the run's trajectory tree, which stores every
    unique token once however long the run.
    """

    tokenizer: ChatTokenizer
    tree: TrajectoryTree
    served: dict[bytes, Served] = field(default_factory=dict)
    arguments: dict[str, str] = field(default_factory=dict)
    """tool-call id -> the arguments string exactly as the model wrote it."""

    def restore(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = []
                for tc in m["tool_calls"]:
                    fn = dict(tc["function"])
                    if tc.get("id") in self.arguments:
                        fn["arguments"] = self.arguments[tc["id"]]
                    calls.append({**tc, "function": fn})
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out

    def input_ids(
        self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[int]:
        messages = self.restore(messages)
        tools_key = json.dumps(tools or [], sort_keys=True)
        digests = prefix_digests(messages, tools_key)
        full = self.tokenizer.render(messages, tools)
        best = next((self.served[d] for d in reversed(digests[:-1]) if d in self.served), None)
        if best is None:
            return self.tokenizer.encode(full)
        closed_text = self.tokenizer.render(
            messages[: best.transcript_len], tools, add_generation_prompt=False
        )
        end = closed_text.rfind("<|im_end|>")
        if end < 0 or not full.startswith(closed_text):
            return self.tokenizer.encode(full)  # a template that is not prefix-stable: render afresh
        # What the template writes after the reply's last model token, then the new messages.
        closing = closed_text[end + len("<|im_end|>") :] if best.closed else closed_text[end:]
        rec = self.tree.record(best.record)
        return (
            rec.input_ids.tolist()
            + rec.output_ids.tolist()
            + self.tokenizer.encode(closing + full[len(closed_text) :])
        )

    def record(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        record: int,
        reply: dict[str, Any],
        closed: bool,
    ) -> dict[str, Any]:
        """Remember a served call; returns what ``remember`` needs to remember it again (the
        proxy keeps these entries on disk, so a restarted proxy reuses ids exactly)."""
        arguments = {tc["id"]: tc["function"]["arguments"] for tc in reply.get("tool_calls") or []}
        transcript = self.restore(messages) + [reply]
        digest = prefix_digests(transcript, json.dumps(tools or [], sort_keys=True))[-1]
        entry = {"digest": digest.hex(), "record": record, "len": len(transcript), "closed": closed}
        self.remember({**entry, "arguments": arguments})
        return {**entry, "arguments": arguments}

    def remember(self, entry: Mapping[str, Any]) -> None:
        """A call as ``record`` described it (an entry whose record the log no longer holds,
        cut off on resume, is ignored)."""
        if not 0 <= entry["record"] < self.tree.num_records:
            return
        self.arguments.update(entry["arguments"])
        self.served[bytes.fromhex(entry["digest"])] = Served(entry["record"], entry["len"], entry["closed"])
