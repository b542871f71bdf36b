"""Moving a request's keys/values between engines (KV migration during a drain).

The source pins the KV of an in-flight request under a handle and keeps it until the
destination acknowledges (``release``); the destination pulls the bytes. ``KVTransfer`` is the
seam the runtime backs with its transport (MPI one-sided reads, RDMA READ); ``HttpKVTransfer``
is the loopback implementation: a GET from the source engine's ``/kv/<handle>``.
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


def pack(tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> bytes:
    return save(
        {
            "tokens": torch.tensor(tokens, dtype=torch.int32),
            "keys": keys.contiguous(),
            "values": values.contiguous(),
        }
    )


def unpack(data: bytes) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    t = load(data)
    return np.asarray(t["tokens"]).tolist(), t["keys"], t["values"]
