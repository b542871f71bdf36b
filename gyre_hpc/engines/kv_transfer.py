"""Moving a request's keys/values between engines (KV migration during a drain).

The source pins the KV of an in-flight request under a handle and keeps it until the
destination acknowledges (``release``); the destination pulls the bytes. ``HttpKVTransfer``, a
GET from the source engine's ``/kv/<handle>``, is the only implementation: the embedded engines
migrate KV over HTTP. ``KVTransfer`` is what an engine server is handed, so another way to
move the bytes would plug in there; none exists (the weight transport's MPI windows and verbs
do not carry KV), and SGLang engines move no KV at all: a drained call continues from its
partial output on another engine, which recomputes the prefix.
"""

from __future__ import annotations

from typing import Protocol

import aiohttp
import numpy as np
import torch
from safetensors.torch import load, save


class KVTransfer(Protocol):
    async def fetch(self, source: str, handle: str) -> bytes: ...


class HttpKVTransfer:
    async def fetch(self, source: str, handle: str) -> bytes:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{source.rstrip('/')}/kv/{handle}") as resp,
        ):
            resp.raise_for_status()
            return await resp.read()


def pack(
    tokens: list[int], keys: torch.Tensor, values: torch.Tensor, routes: torch.Tensor | None = None
) -> bytes:
    """``routes``: a mixture-of-experts model's routed experts of the same positions, which move
    with them (the destination returns them for its cached prefix)."""
    tensors = {
        "tokens": torch.tensor(tokens, dtype=torch.int32),
        "keys": keys.contiguous(),
        "values": values.contiguous(),
    }
    if routes is not None:
        tensors["routes"] = routes.contiguous()
    return save(tensors)


def unpack(data: bytes) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    t = load(data)
    return np.asarray(t["tokens"]).tolist(), t["keys"], t["values"], t.get("routes")
