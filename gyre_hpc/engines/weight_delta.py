"""Weights that travel small (``engine.weight_sync = "delta"``): a version goes to a server as
the elements that changed since the version it holds.

```
 sender (a cell rank, engines.sglang.TensorPush)           receiver (load: SGLang's custom weight
   keeps each bucket it last pushed, in the served dtype     loader, in every TP rank of the server)
   new bucket ─ bits differ from the kept one? ─▶ positions + their new values (few changed),
                                                  the XOR with the kept one, compressed (many),
                                                  or the bucket whole (the smallest of these)
   header: bucket, version, base version, checksum  ──▶  held at the base version? apply; checksum
   verdict ◀──────────────────────────────────────────  OK | STALE | CHECKSUM (written in place)
   any verdict not OK ─▶ the whole version again, every bucket whole
```

Values travel absolute or as the XOR of their bits with the held ones, never as a float
difference, so the served weights are bit for bit those of a whole push. The XOR goes as its
two byte planes (high bytes, then low) through zstd at level 1: at RL learning rates most
changed elements move by an ulp or two, so the XOR is a few low bits and the high plane is
almost all zero (the smoke run at lr 1e-4 changes 44–51 % of the elements, and its XOR packs to
20–22 % of the bucket). Each bucket's checksum is taken over its bits after the update, on both
sides (``checksum``: CRC-32 of its bytes; it guards against a stale or half-applied base, not
against an adversary — no model output reaches this channel).

What it does not know: how a model's ``load_weights`` places a checkpoint tensor. It looks
after the first whole load of each tensor: a tensor the server keeps bit for bit — as a
parameter of its own, or as the one slice of rows of a parameter that fuses it with others of
its module (at tp 1 ``qkv_proj``, ``gate_up_proj``, and everything else) — is patched in place
from then on; any other (a shard at tp > 1, a transformed weight) is rebuilt from a host copy
the receiver keeps and loaded through the model's own ``load_weights``.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

LOADER = "gyre_hpc.engines.weight_delta.load"
"""What the server is told to trust as a custom loader (``--custom-weight-loader``) and each
update names as its ``load_format``."""

HEADER, VERDICT, WHOLE, POSITIONS, VALUES, XOR = (
    f"gyre.delta/{n}" for n in ("header", "verdict", "whole", "positions", "values", "xor")
)
"""The names of one update's entries (every entry must be a tensor: SGLang moves each to its
device before the loader sees it)."""

NONE, OK, STALE, CHECKSUM = 0, 1, 2, 3
"""Verdicts: not answered; applied and checked; the base version is not held; applied but the
checksum disagrees."""


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, in order (a bucket's tensors: the same bytes whether it
    travelled whole or as a delta). Taken on the host (~6 GB/s a core here; a tensor on a GPU
    is copied over first)."""
    crc = 0
    for t in tensors:
        data = t.detach().reshape(-1).view(torch.uint8).cpu().numpy()
        crc = zlib.crc32(memoryview(data), crc)
    return crc


def words_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as 16-bit words (every served dtype is a multiple of two bytes)."""
    return t.reshape(-1).view(torch.int16)


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where ``new``'s bits differ from ``old``'s (a mask over the elements)."""
    bits = _bits(new.element_size())
    return new.reshape(-1).view(bits) != old.reshape(-1).view(bits)


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """The positions (int32, ascending) a mask marks."""
    return torch.nonzero(mask).reshape(-1).to(torch.int32)


def worth_sending(changed: int, elements: int, itemsize: int) -> bool:
    """Whether ``changed`` positions and their values are smaller than the bucket whole."""
    return changed * (4 + itemsize) < elements * itemsize


def xor_packed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The XOR of two tensors' bits, as its byte planes compressed (a byte tensor)."""
    import zstandard

    planes = (words_of(new) ^ words_of(old)).view(torch.uint8).reshape(-1, 2).t().contiguous()
    packed = zstandard.ZstdCompressor(level=1).compress(memoryview(planes.numpy()))
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def xor_unpacked(packed: torch.Tensor, words: int) -> torch.Tensor:
    """``xor_packed``'s XOR again, as ``words`` 16-bit words (on the host)."""
    import zstandard

    data = zstandard.ZstdDecompressor().decompress(bytes(packed.cpu().numpy()), max_output_size=2 * words)
    if len(data) != 2 * words:
        raise ValueError(f"an XOR of {len(data)} bytes for {words} words")
    planes = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(2, words)
    return planes.t().contiguous().view(torch.int16).reshape(-1)


def _bits(itemsize: int) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def header(
    key: int, version: int, base: int, total: int, names: list[str], shapes: list[list[int]]
) -> torch.Tensor:
    """One bucket's header as a byte tensor: its index, the version it brings, the version a
    delta applies to (-1: the bucket whole), its checksum after the update, its tensors."""
    text = json.dumps(
        {"key": key, "version": version, "base": base, "checksum": total, "names": names, "shapes": shapes}
    )
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


@dataclass
class Held:
    """What a receiver keeps between updates (on the model object: one per server rank)."""

    versions: dict[int, int] = field(default_factory=dict)
    """Bucket → the version it holds."""
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors the server keeps bit for bit as a parameter: patched in place."""
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every other tensor, as last loaded, on the host: rebuilt here, loaded whole."""


def load(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: apply one bucket (whole or delta) and write the verdict.
    Never raises on a stale base or a bad checksum (an exception would stop the scheduler);
    the sender reads the verdict and pushes whole."""
    entries = dict(named_tensors)
    head = json.loads(bytes(entries[HEADER].cpu().numpy()).decode())
    held: Held = model.__dict__.setdefault("_gyre_delta", Held())
    if head["base"] < 0:
        verdict = _whole(model, held, head, entries[WHOLE])
    elif held.versions.get(head["key"]) != head["base"]:
        verdict = STALE
    elif XOR in entries:
        verdict = _xor(model, held, head, entries[XOR])
    else:
        verdict = _delta(model, held, head, entries[POSITIONS], entries[VALUES])
    entries[VERDICT].fill_(_agreed(verdict))


def _whole(model: torch.nn.Module, held: Held, head: dict[str, Any], flat: torch.Tensor) -> int:
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    tensors, at = [], 0
    for name, shape in zip(head["names"], head["shapes"], strict=True):
        n = math.prod(shape)
        tensors.append((name, flat[at : at + n].view(shape)))
        at += n
    model.load_weights([(name, t.to(device)) for name, t in tensors])
    for name, t in tensors:
        if name in held.own:
            continue  # where load_weights puts it does not change; the checksum checks it is there
        where = _located(params, name, t.to(device))
        if where is not None:
            held.host.pop(name, None)
            held.own[name] = where
        else:
            held.host[name] = t.to("cpu", copy=True)
    held.versions[head["key"]] = head["version"]
    return _checked(held, head)


def _located(params: dict[str, torch.nn.Parameter], name: str, t: torch.Tensor) -> torch.Tensor | None:
    """Where the server keeps ``t`` bit for bit, as just loaded: its own parameter, or the one
    slice of rows of a parameter of the same module that fuses it with others (``qkv_proj``,
    ``gate_up_proj`` at tp 1); None where it is kept otherwise (a shard, a transform)."""
    p = params.get(name)
    if p is not None and p.shape == t.shape and p.dtype == t.dtype:
        return p.data if torch.equal(words_of(p.data), words_of(t)) else None
    module, kind = name.rsplit(".", 2)[0] + ".", name.rsplit(".", 1)[1]
    rows = t.shape[0] if t.dim() else 0
    found = []
    for other, q in params.items():
        if not (other.startswith(module) and other.endswith(kind) and q.dtype == t.dtype and rows):
            continue
        if q.dim() != t.dim() or q.shape[1:] != t.shape[1:] or q.shape[0] <= rows:
            continue
        fused, mine = q.data.reshape(q.shape[0], -1).view(torch.int16), t.reshape(rows, -1).view(torch.int16)
        for r in torch.nonzero((fused == mine[0]).all(dim=1)).reshape(-1).tolist():
            if r + rows <= q.shape[0] and torch.equal(fused[r : r + rows], mine):
                found.append(q.data.narrow(0, r, rows))
    return found[0] if len(found) == 1 else None


def _delta(
    model: torch.nn.Module, held: Held, head: dict[str, Any], positions: torch.Tensor, values: torch.Tensor
) -> int:
    positions, values = positions.to("cpu", torch.int64), values.to("cpu")
    reload, at = [], 0
    for name, shape in zip(head["names"], head["shapes"], strict=True):
        n = math.prod(shape)
        lo, hi = (int(x) for x in torch.searchsorted(positions, torch.tensor([at, at + n])))
        at += n
        if lo == hi:
            continue
        local, vals = positions[lo:hi] - (at - n), values[lo:hi]
        if name in held.own:
            target = held.own[name].view(-1)
            target[local.to(target.device)] = vals.to(target.device)
        else:
            base = held.host[name]
            base.view(-1)[local] = vals
            reload.append((name, base))
    if reload:
        device = next(model.parameters()).device
        model.load_weights([(name, t.to(device)) for name, t in reload])
    held.versions[head["key"]] = head["version"]
    return _checked(held, head)


def _xor(model: torch.nn.Module, held: Held, head: dict[str, Any], packed: torch.Tensor) -> int:
    sizes = [math.prod(shape) for shape in head["shapes"]]
    kept = [held.own[name] if name in held.own else held.host[name] for name in head["names"]]
    words = sum(len(words_of(t)) for t in kept)
    try:
        xor = xor_unpacked(packed, words)
    except Exception:  # noqa: BLE001 - a bad blob is a disagreement, not a crash of the scheduler
        return CHECKSUM
    reload, at = [], 0
    for name, t, n in zip(head["names"], kept, sizes, strict=True):
        w = words_of(t)
        part, at = xor[at : at + len(w)], at + len(w)
        if n and bool(part.any()):
            w ^= part.to(w.device)
            if name not in held.own:
                reload.append((name, t))
    if reload:
        device = next(model.parameters()).device
        model.load_weights([(name, t.to(device)) for name, t in reload])
    held.versions[head["key"]] = head["version"]
    return _checked(held, head)


def _checked(held: Held, head: dict[str, Any]) -> int:
    tensors = (held.own[name] if name in held.own else held.host[name] for name in head["names"])
    return OK if checksum(tensors) == head["checksum"] else CHECKSUM


def _agreed(verdict: int) -> int:
    """The worst verdict of the server's TP ranks (each applied the bucket to its own shard;
    only the first rank's verdict is the sender's tensor, the others' are copies)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return verdict
    try:
        from sglang.srt.distributed import get_tp_group
    except ImportError:
        return verdict
    group = get_tp_group()
    if group.world_size == 1:
        return verdict
    worst = torch.tensor([verdict], dtype=torch.int32)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return int(worst.item())
