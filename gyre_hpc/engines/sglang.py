"""The SGLang backend: a cell's own ``sglang.launch_server`` process, driven by ``EngineClient``.

```
 start ─▶ launch on a free port (GPUs from the cell's local rank; CPU flags where there is none)
       ─▶ /health ─▶ weight group: the cell leader as rank 0 + the server's TP ranks (gloo | NCCL)
 load(flat, v) ─▶ begin_weight_update ─▶ update_weights_from_distributed per bucket: the flat
                  buffer cut into engine.weight_bucket_mb buckets, each cast to the served dtype
                  and broadcast as a flattened bucket ─▶ end_weight_update
                  (or: a model directory on disk, loaded with update_weights_from_disk)
 send(verb)     ─▶ pause_generation(abort) / continue_generation / release_memory_occupation /
                  resume_memory_occupation, in the sequences engines.colocation writes
 stop ─▶ the process group of the server (its scheduler and detokenizer processes too)
```

The command is a pure function of the engine config (golden-tested). Verbs that crash or refuse
while requests run (``flush_cache``, ``release_memory_occupation``) are never sent here: the cell
pauses a server only after the proxy has drained it. This module knows nothing about roles,
versions' meaning or the schedule.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import io
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from gyre_hpc.engines import weight_delta as wd
from gyre_hpc.engines.client import EngineClient, EngineError, Sent
from gyre_hpc.engines.pushed import Pushed
from gyre_hpc.engines.weight_delta import LOADER
from gyre_hpc.errors import LaunchError
from gyre_hpc.launch.ports import free_port
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.recipe.schema import EngineConfig

if TYPE_CHECKING:  # torch is imported where a push needs it
    from gyre_hpc.engines.staging import Tensors

T = TypeVar("T")
log = logging.getLogger(__name__)
UPDATED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
"""SGLang's 400 when the update succeeded but calls were running, so the cache stayed."""

STOP_GRACE_S = 1.0
"""How long a stopped server has after SIGTERM before its group is killed."""

CPU_TOKENS = 16384
"""KV cache tokens of a CPU server when ``engine.max_total_tokens`` is 0."""


def sglang_command(
    engine: EngineConfig,
    model: str,
    port: int,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    device: str = "cuda",
    gpu: int = 0,
    span: Span | None = None,
    routes: bool = False,
) -> list[str]:
    """The server's command line; ``device`` is resolved (cpu | cuda), ``gpu`` its first GPU,
    ``span`` this part's place in a replica across nodes; ``routes``: it returns the experts it
    routed each token to when a call asks (a MoE model under ``trainer.routing_replay``)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port)]
    cmd += ["--tp-size", str(engine.tp_size), "--weight-version", "0", "--skip-server-warmup"]
    if engine.ep_size > 1:
        cmd += ["--ep-size", str(engine.ep_size)]
    if engine.attn_dp_size > 1:
        cmd += ["--attn-dp-size", str(engine.attn_dp_size)]
    if engine.moe_a2a_backend != "none":
        cmd += ["--moe-a2a-backend", engine.moe_a2a_backend]
    if routes:
        cmd.append("--enable-return-routed-experts")
    if span is not None:
        cmd += ["--nnodes", str(span.nnodes), "--node-rank", str(span.node_rank)]
        cmd += ["--dist-init-addr", span.dist_init_addr]
    if device == "cpu":
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch"]
        cmd += ["--disable-cuda-graph", "--grammar-backend", "none"]
        # Idle, the scheduler spins a whole core; here the cores are the trainer's and the agents'.
        cmd.append("--sleep-on-idle")
        cmd += ["--max-total-tokens", str(engine.max_total_tokens or CPU_TOKENS)]
    else:
        cmd += ["--base-gpu-id", str(gpu), "--mem-fraction-static", str(engine.mem_fraction_static)]
        if engine.enable_memory_saver:
            cmd.append("--enable-memory-saver")  # it needs libcuda: GPU only
        if engine.max_total_tokens:
            cmd += ["--max-total-tokens", str(engine.max_total_tokens)]
    if engine.dtype != "auto":
        cmd += ["--dtype", engine.dtype]
    if not engine.prefix_cache:
        cmd.append("--disable-radix-cache")
    if engine.weight_sync == "delta":
        cmd += ["--custom-weight-loader", LOADER]
    return cmd


@dataclass(frozen=True)
class Span:
    """A part of a replica that spans nodes: SGLang's --nnodes, --node-rank, --dist-init-addr
    (host:port of the head part's node, where its ranks meet)."""

    nnodes: int
    node_rank: int
    dist_init_addr: str

    @property
    def head(self) -> bool:
        return self.node_rank == 0


def server_env(device: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: SGLang's CPU engine on the CPU; on a GPU, one NCCL_CUMEM_ENABLE
    for both ends of the weight group (SGLang sets 0 in its processes when it is unset, and
    peers whose two sides differ see weight syncs fail)."""
    if device == "cpu":
        return dict(environ, SGLANG_USE_CPU_ENGINE="1")
    return dict(environ, NCCL_CUMEM_ENABLE=environ.get("NCCL_CUMEM_ENABLE", "0"))


def cpu_threads_bind(cores: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for ``ranks`` TP ranks of a part on the CPU: the cores it may
    use cut into that many contiguous groups (``0|1``; ``0,1|2,3``), sharing when there are
    fewer. SGLang's CPU engine refuses more TP ranks than NUMA nodes without it."""
    cores = sorted(cores)
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    size = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * size : (r + 1) * size])) for r in range(ranks))


def call(
    url: str, verb: Callable[[EngineClient], Awaitable[T]], timeout_s: float = 600.0, sent: Sent | None = None
) -> T:
    """One verb of ``EngineClient``, from synchronous code (the cell's loop)."""

    async def go() -> T:
        async with EngineClient(url, timeout_s=timeout_s, sent=sent) as client:
            return await verb(client)

    return asyncio.run(go())


def served_dtype(engine_dtype: str, model_dir: Path) -> str:
    """The dtype a server computes in: the recipe's, or for ``auto`` SGLang's own rule — the
    checkpoint's ``torch_dtype``, except that float32 is served as float16."""
    if engine_dtype != "auto":
        return engine_dtype
    try:
        stored = json.loads((model_dir / "config.json").read_text()).get("torch_dtype") or "float32"
    except (OSError, ValueError):
        stored = "float32"
    return "float16" if stored == "float32" else str(stored)


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of the flat layout, sent in one broadcast: elements [start, end)."""

    names: list[str]
    shapes: list[list[int]]
    start: int
    end: int


def buckets(layout: FlatLayout, itemsize: int, limit_bytes: int) -> list[Bucket]:
    """The layout's tensors in order, cut into buckets of at most ``limit_bytes`` in a dtype of
    ``itemsize`` bytes (a tensor larger than that is a bucket of its own)."""
    out: list[Bucket] = []
    names: list[str] = []
    shapes: list[list[int]] = []
    start = end = 0
    for name, (at, shape) in layout.slots.items():
        n = shape.numel()
        if names and (end + n - start) * itemsize > limit_bytes:
            out.append(Bucket(names, shapes, start, end))
            names, shapes, start = [], [], at
        names.append(name)
        shapes.append(list(shape))
        end = at + n
    if names:
        out.append(Bucket(names, shapes, start, end))
    return out


def unflushed_ok(url: str, version: int, send: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """An update's reply, where SGLang's "updated, but the cache was not flushed" (calls were
    still running or waiting) counts as done: the weights are in, and no call reuses the old
    prefixes anyway (each call's cache key is its engine's version)."""
    try:
        return send()
    except EngineError as err:
        if UPDATED_NOT_FLUSHED not in str(err):
            raise
        log.info("%s: version %s loaded, prefix cache kept (keyed by version): %s", url, version, err)
        return {"success": True}


class WeightGroup:
    """The cell leader's side of a process group it forms with its server: rank 0 broadcasts
    a version's tensors bucket by bucket (``engines.staging``), cast to the served dtype, and the
    server's TP ranks (1 … tp) receive each as a flattened bucket — one bucket staged at a time
    on either side."""

    def __init__(
        self,
        url: str,
        layout: FlatLayout,
        host: str,
        tp_size: int,
        backend: str,
        dtype: str = "float32",
        bucket_bytes: int = 512 << 20,
        sent: Sent | None = None,
    ) -> None:
        self.url, self.layout, self.backend, self.dtype = url, layout, backend, dtype
        self.sent = sent
        self.name = f"gyre-weights-{uuid.uuid4().hex[:8]}"  # group names are unique per process
        self.buckets = buckets(layout, _itemsize(dtype), bucket_bytes)
        """How a snapshot in the shared layout's order is cut (a stream cuts itself the same way)."""
        self.bucket_bytes = bucket_bytes
        self.peak_bytes = 0
        """The largest bucket staged so far (what a push adds on the sending device)."""
        port = free_port(host)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The server's side blocks until rank 0 joins: ask it in a thread, join here.
            joined = pool.submit(
                call,
                url,
                lambda c: c.init_weights_update_group(host, port, 1, 1 + tp_size, self.name, backend),
            )
            self.group = _process_group(backend, host, port, 1 + tp_size, self.name)
            reply = joined.result()
        if not reply.get("success"):
            raise LaunchError(f"{url}: init_weights_update_group failed: {reply.get('message')}")

    def push(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        """A flat snapshot, or a stream of its tensors (``engines.staging``)."""
        import torch

        from gyre_hpc.engines.staging import Stager, served_tensors

        tensors = served_tensors(self.layout, weights)
        dtype = getattr(torch, self.dtype)
        device = "cuda" if self.backend == "nccl" else "cpu"
        stager = Stager(dtype, self.bucket_bytes, lambda n: torch.empty(n, dtype=dtype, device=device))
        sent = 0
        for bucket in stager.stage(tensors):
            sent += bucket.data.numel() * bucket.data.element_size()
            self._send(bucket.names, bucket.shapes, bucket.data.view(torch.uint8), str(version), bucket.last)
        self.peak_bytes = max(self.peak_bytes, stager.peak_bytes)
        return Pushed(sent=sent, whole=sent, changed=None, elements=stager.elements)

    def _send(self, names: list[str], shapes: list[list[int]], data: Any, version: str, flush: bool) -> None:
        import torch

        dtypes = [self.dtype] * len(names)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            update = lambda c: c.update_weights_from_distributed(  # noqa: E731
                names, dtypes, shapes, self.name, version, flush_cache=flush
            )
            received = pool.submit(call, self.url, update, sent=self.sent)
            torch.distributed.broadcast(data, src=0, group=self.group)
            reply = unflushed_ok(self.url, version, received.result)
        if not reply.get("success"):
            raise EngineError(f"{self.url}: update_weights_from_distributed failed: {reply.get('message')}")

    def close(self) -> None:
        import torch

        torch.distributed.destroy_process_group(self.group)


class TensorPush:
    """Weights into a server on this rank's node by reference: each bucket is staged once, cast to
    the served dtype (on this rank's GPU, or in a shared-memory file on the CPU), and every TP
    rank of the server reads it there (CUDA IPC, or the file) through SGLang's tensor verb. No
    process group: no GPU twice in a communicator, and one bucket staged at a time
    (``engines.staging``).

    With ``delta`` (``engine.weight_sync = "delta"``) a bucket goes as the elements that changed
    since the version the server holds (``engines.weight_delta``): this side keeps every bucket
    it last pushed, in the served dtype, on the host, by the names it holds.

    With ``peers`` (the head of a replica across nodes) each bucket is staged on every node of
    the replica: the other parts' ranks stage it on theirs (``PartPush``) and hand their
    references here, and one request carries every TP rank its own node's reference
    (``tp_entries``). Delta is not offered across nodes."""

    def __init__(
        self,
        url: str,
        layout: FlatLayout,
        tp_size: int,
        device: str,
        dtype: str,
        bucket_bytes: int,
        delta: bool = False,
        sent: Sent | None = None,
        peers: HeadPeers | None = None,
        nnodes: int = 1,
    ) -> None:
        """``device``: where a bucket is staged — ``cpu``, or ``cuda:N``, the server's first GPU."""
        self.url, self.layout, self.tp_size, self.device, self.dtype = url, layout, tp_size, device, dtype
        self.sent, self.peers, self.local = sent, peers, tp_size // nnodes
        assert peers is None or not delta, "a replica across nodes takes whole buckets"
        self.buckets = buckets(layout, _itemsize(dtype), bucket_bytes)
        """How a snapshot in the shared layout's order is cut (a stream cuts itself the same way)."""
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.peak_bytes = 0
        self.held: dict[tuple[str, ...], Any] = {}
        """Delta: each bucket as last pushed (served dtype, host), by its tensors' names."""
        self.held_version: int | None = None

    def forget(self) -> None:
        """The server's weights are no longer the last ones pushed (released memory holds no
        weights): the next version goes whole."""
        self.held, self.held_version = {}, None

    def push(self, weights: np.ndarray | Tensors, version: int, flush: bool = True) -> Pushed:
        """A flat snapshot, or a stream of its tensors (``engines.staging``). ``flush``: drop the
        server's prefix cache with the last bucket (False keeps it, as SGLang does anyway while
        calls run)."""
        import torch

        _share_from(self.device)
        from gyre_hpc.engines.staging import served_tensors

        tensors = served_tensors(self.layout, weights)
        dtype = getattr(torch, self.dtype)
        if not self.delta:
            return self._whole(tensors, dtype, version, flush)
        pushed = self._deltas(tensors, dtype, version, flush)
        self.held_version = version
        return pushed

    def _stager(self, dtype: Any) -> Any:
        return _stager(self.device, dtype, self.bucket_bytes)

    def _whole(self, tensors: Tensors, dtype: Any, version: int, flush: bool) -> Pushed:
        sent, stager = 0, self._stager(dtype)
        for i, b in enumerate(stager.stage(tensors)):
            sent += b.data.numel() * b.data.element_size()
            refs = [_reference(_flattened(b, dtype)) for _ in range(self.local)]
            if self.peers is not None:  # every other node's references to its own copy
                refs = tp_entries([refs, *self.peers.references(version, i)], self.tp_size)
            self._post(refs, version, flush and b.last, "flattened_bucket")
            if self.peers is not None:
                self.peers.read(version, i)  # their copies may go: the server holds the bucket
            del refs  # the server copied the bucket into its weights
        self.peak_bytes = max(self.peak_bytes, stager.peak_bytes)
        return Pushed(sent=sent, whole=sent, changed=None, elements=stager.elements)

    def _deltas(self, tensors: Tensors, dtype: Any, version: int, flush: bool) -> Pushed:
        """Every bucket as a delta over the kept one. A bucket the server refuses (it holds
        another base, or the checksum disagrees) goes again whole, and so does every bucket
        after it: the stream is read once (a cell's other ranks may be sending it)."""
        sent = changed = 0
        whole = self.held_version is None
        stager = self._stager(dtype)
        for i, b in enumerate(stager.stage(tensors)):
            key = tuple(b.names)
            new = b.data.clone()  # kept: the base of the next version's delta
            old = None if whole else self.held.get(key)
            mask = None if old is None else wd.changed(new, old)
            n = new.numel() if mask is None else int(mask.sum())
            verdict, bytes_ = self._bucket(i, b, new, old, mask, version, flush)
            sent += bytes_
            if verdict != wd.OK and old is not None:
                log.warning("%s: bucket %d of version %d: verdict %d; the rest goes whole",
                            self.url, i, version, verdict)  # fmt: skip
                whole, n = True, new.numel()
                verdict, bytes_ = self._bucket(i, b, new, None, None, version, flush)
                sent += bytes_
            if verdict != wd.OK:
                self.forget()
                raise EngineError(
                    f"{self.url}: bucket {i} of version {version} pushed whole: verdict {verdict}"
                )
            changed += n
            self.held[key] = new
        self.peak_bytes = max(self.peak_bytes, stager.peak_bytes)
        itemsize = _itemsize(self.dtype)
        return Pushed(sent=sent, whole=stager.elements * itemsize, changed=changed, elements=stager.elements)

    def _bucket(
        self, i: int, b: Any, new: Any, old: Any, mask: Any, version: int, flush: bool
    ) -> tuple[int, int]:
        """One bucket, as a delta over ``old`` (None: whole): the server's verdict, bytes sent."""
        import torch

        n = new.numel() if mask is None else int(mask.sum())
        # Few changed: their positions and values. Many: their XOR with the kept bucket,
        # packed, where that is smaller (listing half a bucket's positions costs more).
        listed = None if mask is None else n * (4 + new.element_size())
        xor = positions = None
        if listed is not None and listed >= new.numel() * new.element_size() / 8:
            xor = wd.xor_packed(new, old)
            if xor.numel() >= min(listed, 0.9 * new.numel() * new.element_size()):
                xor = None
        if xor is None and listed is not None and wd.worth_sending(n, len(new), new.element_size()):
            positions = wd.positions_of(mask)
        base = -1 if positions is None and xor is None else self.held_version
        entries = {
            wd.HEADER: wd.header(i, version, base, wd.checksum([new]), b.names, b.shapes),
            wd.VERDICT: torch.zeros(1, dtype=torch.int32),
        }
        if xor is not None:
            entries[wd.XOR] = xor
        elif positions is None:
            entries[wd.WHOLE] = new
        else:
            entries[wd.POSITIONS], entries[wd.VALUES] = positions, new[positions.long()]
        staged = {name: self._stage(t) for name, t in entries.items()}
        self._update(list(staged.items()), version, flush and b.last, LOADER)
        return int(staged[wd.VERDICT].item()), sum(t.numel() * t.element_size() for t in staged.values())

    def _stage(self, t: Any) -> Any:
        """Where the server's ranks read it: a shared-memory file, or this rank's GPU."""
        staged = t.share_memory_() if self.device == "cpu" else t.to(self.device)
        self.peak_bytes = max(self.peak_bytes, staged.numel() * staged.element_size())
        return staged

    def _update(self, payload: Any, version: int, flush: bool, load_format: str) -> None:
        # One reference per TP rank: each rank opens its own (CUDA IPC counts references).
        self._post([_reference(payload) for _ in range(self.tp_size)], version, flush, load_format)

    def _post(self, refs: list[str], version: int, flush: bool, load_format: str) -> None:
        """One tensor verb: TP rank r reads ``refs[r]``."""
        update = lambda c: c.update_weights_from_tensor(refs, str(version), flush, load_format)  # noqa: E731
        reply = unflushed_ok(self.url, version, lambda: call(self.url, update, sent=self.sent))
        if not reply.get("success"):
            raise EngineError(f"{self.url}: update_weights_from_tensor failed: {reply.get('message')}")

    def close(self) -> None:
        """Nothing is held between pushes but the kept buckets (this object's)."""


class HeadPeers(Protocol):
    """What the head of a replica across nodes asks of its other parts, bucket by bucket (the
    cell's ranks carry it: ``runtime.span``)."""

    def references(self, version: int, bucket: int) -> list[list[str]]:
        """Each other part, in node order, staged ``bucket``: its references to its copy."""
        ...

    def read(self, version: int, bucket: int) -> None:
        """The server holds ``bucket``: the other parts may stage the next one over it."""
        ...


class PartPeers(Protocol):
    """What a part of a replica across nodes (not its head) hears from its head and answers."""

    def word(self, version: int) -> tuple[str, int]:
        """The head's next word: ("ask", bucket), ("read", bucket) or ("end", -1), its load
        over (whatever became of it)."""
        ...

    def offer(self, version: int, bucket: int, references: list[str]) -> None:
        """This part's references to its copy of ``bucket``."""
        ...


def tp_entries(by_node: list[list[str]], tp_size: int) -> list[str]:
    """SGLang's tensor verb takes one serialized entry per TP rank, and TP rank r of a replica
    across n nodes runs on node r // (tp_size / n): each node's references, in node order."""
    local = tp_size // len(by_node)
    if local * len(by_node) != tp_size or any(len(refs) != local for refs in by_node):
        raise ValueError(f"{[len(r) for r in by_node]} references for {tp_size} TP ranks over "
                         f"{len(by_node)} nodes: each node gives one for each of its {local}")  # fmt: skip
    return [ref for refs in by_node for ref in refs]


class PartPush:
    """A part of a replica across nodes that is not its head, when weights go by reference: it
    stages each bucket of the stream on its own node (its GPU, or a shared-memory file), cut
    as its head cuts it, and hands its head references for its node's TP ranks when asked.

    ```
     head (node 0)                             this part (node k)
       stages bucket i                           stages bucket i  (both have read the same tensors)
       ── ask i ───────────────────────────────▶
       ◀─────────────────────────── its node's references to bucket i
       one request: tp_entries(every node's)
       ── read i ──────────────────────────────▶ (it may stage bucket i + 1 over it)
       ...
       ── end ─────────────────────────────────▶ (after the head's load, whatever became of it)
    ```

    Each side waits for the other only at a bucket's end, where both have read the same
    tensors: the ranks that send them (``MegatronTrainer.hf_tensors``) never wait on a part
    that waits on its head."""

    def __init__(
        self, layout: FlatLayout, local: int, device: str, dtype: str, bucket_bytes: int, peers: PartPeers
    ) -> None:
        self.layout, self.local, self.device, self.dtype = layout, local, device, dtype
        self.bucket_bytes, self.peers = bucket_bytes, peers

    def push(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        """What this node staged (the caller reads the rest of a stream its head ended early)."""
        import torch

        from gyre_hpc.engines.staging import served_tensors

        _share_from(self.device)
        tensors = served_tensors(self.layout, weights)
        dtype = getattr(torch, self.dtype)
        stager, sent, elements, word = _stager(self.device, dtype, self.bucket_bytes), 0, 0, None
        for i, b in enumerate(stager.stage(tensors)):
            word = self.peers.word(version)  # only now, with this bucket's tensors read
            if word[0] == "end":
                break
            if word != ("ask", i):
                raise EngineError(f"the head of this replica asked {word}, expected bucket {i}")
            self.peers.offer(version, i, [_reference(_flattened(b, dtype)) for _ in range(self.local)])
            word = self.peers.word(version)
            if word[0] == "end":
                break
            if word != ("read", i):
                raise EngineError(f"the head of this replica said {word}, expected bucket {i} read")
            sent += b.data.numel() * b.data.element_size()
            elements, word = elements + b.data.numel(), None
        while word is None or word[0] != "end":
            word = self.peers.word(version)
            if word[0] != "end":
                raise EngineError(f"the head of this replica asked {word} past this part's last bucket")
        return Pushed(sent=sent, whole=sent, changed=None, elements=elements)


def _flattened(b: Any, dtype: Any) -> dict[str, Any]:
    """A staged bucket as SGLang's ``flattened_bucket`` payload."""
    import torch

    return {"flattened_tensor": b.data.view(torch.uint8), "metadata": _metadata(b.names, b.shapes, dtype)}


def _stager(device: str, dtype: Any, bucket_bytes: int) -> Any:
    """Buckets staged where a server's ranks read them: a shared-memory file, or ``device``."""
    import torch

    from gyre_hpc.engines.staging import Stager

    def allocate(n: int) -> Any:
        if device == "cpu":
            return torch.empty(n, dtype=dtype).share_memory_()
        return torch.empty(n, dtype=dtype, device=device)

    return Stager(dtype, bucket_bytes, allocate)


def _share_from(device: str) -> None:
    """How tensors staged on ``device`` are referred to from another process."""
    import torch

    if device == "cpu":
        # A file the server opens by name: the default (a descriptor handed over a socket)
        # needs the receiver to be a child of this process.
        torch.multiprocessing.set_sharing_strategy("file_system")
        _start_shm_manager()
    else:
        # GPUs named by UUID, not index, as SGLang's own senders do: its ranks may number the
        # node's GPUs differently.
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()


@functools.cache  # once a process, as torch starts it
def _start_shm_manager() -> None:
    """Start torch's shared-memory manager (a daemon, made by the first tensor shared by file)
    with its output on /dev/null: it lives as long as the server holds a bucket of ours, and with
    this process's stdout it would keep a launcher that waits for that to close (mpirun) from
    ever seeing this process end."""
    import torch

    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        torch.empty(1).share_memory_()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _metadata(names: list[str], shapes: list[list[int]], dtype: Any) -> list[types.SimpleNamespace]:
    """What SGLang's flattened bucket needs of each tensor: its name, shape, dtype and byte range
    (a SimpleNamespace, which its unpickler accepts)."""
    out, at = [], 0
    size = dtype.itemsize
    for name, shape in zip(names, shapes, strict=True):
        n = math.prod(shape) * size
        out.append(
            types.SimpleNamespace(name=name, shape=shape, dtype=dtype, start_idx=at, end_idx=at + n, numel=n)
        )
        at += n
    return out


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


def _reference(obj: object) -> str:
    """``obj`` pickled the way torch shares tensors between processes, in base64."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers how tensors and storages are shared

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def _process_group(backend: str, host: str, port: int, size: int, name: str) -> Any:
    """Rank 0 of a process group of its own (not torch's default group, which a megatron cell
    may already hold), formed the way SGLang forms its side."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=300)
    store, _, _ = next(rendezvous(f"tcp://{host}:{port}", 0, size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        size, 0, [], Backend(backend), PrefixStore(name, store), group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {r: r for r in range(size)}
    return group


class SGLangServer:
    """One SGLang server process and the verbs a cell drives it with."""

    def __init__(
        self,
        engine: EngineConfig,
        model_dir: Path,
        work_dir: Path,
        host: str = "127.0.0.1",
        device: str = "cpu",
        gpu: int = 0,
        python: str = sys.executable,
        port: int = 0,
        span: Span | None = None,
        group_host: str = "127.0.0.1",
        peers: HeadPeers | None = None,
        routes: bool = False,
    ) -> None:
        """``group_host``: where this rank's end of the weight group listens (its node's name
        when the replica spans nodes, so their ranks reach it); ``peers``: the other parts of
        a replica across nodes that takes its weights by reference (``PartPush``); ``routes``:
        it can return routed experts (``sglang_command``)."""
        self.engine, self.model_dir, self.work_dir, self.device = engine, model_dir, work_dir, device
        self.gpu, self.span, self.group_host, self.peers = gpu, span, group_host, peers
        self.port = port or free_port(host)
        self.url = f"http://127.0.0.1:{self.port}"  # the cell and its server share a node
        self.cmd = sglang_command(engine, str(model_dir), self.port, host, python, device, gpu, span, routes)
        self.log = work_dir / "sglang.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.group: WeightGroup | TensorPush | None = None
        self.layout = FlatLayout.of(ModelConfig.load(model_dir))
        self.sent: Sent | None = None
        """A fault point: called with the path of each request this side sends it (tests)."""

    def start(self) -> int:
        """Launch and wait until healthy (and the weight group is formed); returns the port. A
        part that is not its replica's head serves no HTTP: it is launched, and its head's
        health says when the replica is up."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = server_env(self.device, os.environ)
        if self.device == "cpu" and self.engine.tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            local = self.engine.tp_size // (self.span.nnodes if self.span else 1)
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(sorted(os.sched_getaffinity(0)), local)
        if self.device == "cuda":  # this process's NCCL (the weight group, the trainer) agrees
            os.environ["NCCL_CUMEM_ENABLE"] = env["NCCL_CUMEM_ENABLE"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        if self.span is not None and not self.span.head:
            return self.port
        deadline = time.monotonic() + self.engine.start_timeout_s
        while not call(self.url, lambda c: c.health(), timeout_s=5, sent=self.sent):
            if self.proc.poll() is not None:
                raise LaunchError(f"sglang exited with code {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                timeout = self.engine.start_timeout_s
                raise LaunchError(f"sglang not healthy after {timeout:g} s; see {self.log}")
            time.sleep(0.5)
        dtype, bucket = served_dtype(self.engine.dtype, self.model_dir), self.engine.weight_bucket_mb << 20
        if self.engine.weight_sync in ("tensor", "delta"):
            delta = self.engine.weight_sync == "delta"
            nnodes = self.span.nnodes if self.span is not None else 1
            self.group = TensorPush(self.url, self.layout, self.engine.tp_size, self.staged_on, dtype, bucket,
                                    delta, sent=self.sent, peers=self.peers, nnodes=nnodes)  # fmt: skip
        elif self.engine.weight_sync == "broadcast":
            backend = "gloo" if self.device == "cpu" else "nccl"
            self.group = WeightGroup(
                self.url, self.layout, self.group_host, self.engine.tp_size, backend, dtype, bucket, self.sent
            )
        return self.port

    @property
    def staged_on(self) -> str:
        """Where a bucket pushed by reference is staged: ``cpu``, or this server's first GPU."""
        return "cpu" if self.device == "cpu" else f"cuda:{self.gpu}"

    def part_push(self, peers: PartPeers) -> PartPush:
        """This part's pusher, when it is not its replica's head and weights go by reference."""
        assert self.span is not None and not self.span.head
        dtype = served_dtype(self.engine.dtype, self.model_dir)
        local = self.engine.tp_size // self.span.nnodes
        return PartPush(self.layout, local, self.staged_on, dtype, self.engine.weight_bucket_mb << 20, peers)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, verb: str) -> None:
        """One of the verbs ``engines.colocation`` names: pause_generation (aborting nothing: the
        proxy drained the server), continue_generation, release_memory_occupation,
        resume_memory_occupation."""
        verbs = {
            "pause_generation": lambda c: c.pause("abort"),
            "continue_generation": lambda c: c.continue_(),
            "release_memory_occupation": lambda c: c.release_memory(),
            "resume_memory_occupation": lambda c: c.resume_memory(),
        }
        call(self.url, verbs[verb], sent=self.sent)
        if verb == "release_memory_occupation" and isinstance(self.group, TensorPush):
            self.group.forget()  # released memory keeps no weights to apply a delta to

    def load(self, weights: np.ndarray | Tensors, version: int) -> Pushed:
        """Serve ``weights`` as ``version`` from now on (a flat snapshot, or a stream of its
        tensors: ``engines.staging``); what it moved."""
        from gyre_hpc.engines.staging import served_tensors
        from gyre_hpc.models.hf_files import copy_model_files, write_buckets

        tensors = served_tensors(self.layout, weights)
        if self.group is None:  # engine.weight_sync = "disk"
            out = self.work_dir / "weights"
            shutil.rmtree(out, ignore_errors=True)  # the last version's files, cut another way
            copy_model_files(self.model_dir, out)
            counted = _Counted(tensors)
            write_buckets(counted, out, self.engine.weight_bucket_mb << 20)
            update = lambda c: c.update_weights_from_disk(str(out), str(version))  # noqa: E731
            reply = call(self.url, update, sent=self.sent)
            if not reply.get("success"):
                raise EngineError(f"{self.url}: update_weights_from_disk failed: {reply.get('message')}")
            return Pushed(sent=counted.bytes, whole=counted.bytes, changed=None, elements=counted.elements)
        call(self.url, lambda c: c.begin_weight_update(), sent=self.sent)
        try:
            return self.group.push(tensors, version)
        finally:
            call(self.url, lambda c: c.end_weight_update(), sent=self.sent)

    def stop(self) -> None:
        """Stop the server and every process it started (they share its session)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # Nothing of ours is left in it (its calls were drained): a second for its logs, no
            # more. Its group's SIGTERM ends its scheduler first, which the server reads as a
            # crash and answers with 5 s "to let GPU activity settle"; a SIGTERM to the server
            # alone drains for ~7 s.
            _signal(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _signal(self.proc.pid, signal.SIGKILL)  # its scheduler and detokenizer, whatever became of it
        self.proc.wait()
        if self.group is not None:
            self.group.close()
            self.group = None


class _Counted:
    """A stream of tensors that counts what passed."""

    def __init__(self, tensors: Tensors) -> None:
        self.tensors, self.bytes, self.elements = tensors, 0, 0

    def __iter__(self) -> Any:
        for name, t in self.tensors:
            self.bytes += t.numel() * t.element_size()
            self.elements += t.numel()
            yield name, t


def _signal(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
