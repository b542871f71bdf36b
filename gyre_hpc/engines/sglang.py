"""The SGLang backend: a cell's own ``sglang.launch_server`` process, driven by ``EngineClient``.

```
 start ─▶ launch on a free port (GPUs from the cell's local rank; CPU flags where there is none)
       ─▶ /health ─▶ weight group: the cell leader as rank 0 + the server's TP ranks (gloo | NCCL)
 load(flat, v) ─▶ begin_weight_update ─▶ update_weights_from_distributed: the whole flat buffer
                  broadcast once as a flattened bucket (names and shapes from models.flat)
                  ─▶ end_weight_update                   (or: a model directory on disk, loaded
                                                           with update_weights_from_disk)
 pause / resume ─▶ pause_generation(abort) / continue_generation (on a GPU with the memory saver
                  also release_memory_occupation / resume_memory_occupation, for the trainer)
 stop ─▶ the process group of the server (its scheduler and detokenizer processes too)
```

The command is a pure function of the engine config (golden-tested). Verbs that crash or refuse
while requests run (``flush_cache``, ``release_memory_occupation``) are never sent here: the cell
pauses a server only after the proxy has drained it. This module knows nothing about roles,
versions' meaning or the schedule.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gyre_hpc.engines.client import EngineClient, EngineError
from gyre_hpc.errors import LaunchError
from gyre_hpc.models.flat import FlatLayout
from gyre_hpc.models.qwen3 import Qwen3Config
from gyre_hpc.recipe.schema import EngineConfig

T = TypeVar("T")
log = logging.getLogger(__name__)
UPDATED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
"""SGLang's 400 when the update succeeded but calls were running, so the cache stayed."""

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
) -> list[str]:
    """The server's command line; ``device`` is resolved (cpu | cuda), ``gpu`` its first GPU."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port)]
    cmd += ["--tp-size", str(engine.tp_size), "--weight-version", "0", "--skip-server-warmup"]
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
    return cmd


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def call(url: str, verb: Callable[[EngineClient], Awaitable[T]], timeout_s: float = 600.0) -> T:
    """One verb of ``EngineClient``, from synchronous code (the cell's loop)."""

    async def go() -> T:
        async with EngineClient(url, timeout_s=timeout_s) as client:
            return await verb(client)

    return asyncio.run(go())


class WeightGroup:
    """The cell leader's side of a process group it forms with its server: rank 0 broadcasts
    the whole flat snapshot, the server's TP ranks (1 … tp) receive it as one flattened bucket."""

    def __init__(self, url: str, layout: FlatLayout, host: str, tp_size: int, backend: str) -> None:
        self.url, self.layout, self.backend = url, layout, backend
        self.name = f"gyre-weights-{uuid.uuid4().hex[:8]}"  # group names are unique per process
        self.names = list(layout.slots)
        self.shapes = [list(shape) for _, shape in layout.slots.values()]
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

    def push(self, flat: np.ndarray, version: int) -> None:
        import torch

        buffer = torch.from_numpy(flat).view(torch.uint8)  # float32 tensors back to back: the bucket
        if self.backend == "nccl":
            buffer = buffer.cuda()
        dtypes = ["float32"] * len(self.names)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            update = lambda c: c.update_weights_from_distributed(  # noqa: E731
                self.names, dtypes, self.shapes, self.name, str(version)
            )
            received = pool.submit(call, self.url, update)
            torch.distributed.broadcast(buffer, src=0, group=self.group)
            try:
                reply = received.result()
            except EngineError as err:
                if UPDATED_NOT_FLUSHED not in str(err):
                    raise
                # The weights are in; only the prefix cache could not be dropped, because calls
                # reached a server that had just come back. What it computed is in the TITO log.
                log.warning("%s: version %s loaded, prefix cache kept: %s", self.url, version, err)
                return
        if not reply.get("success"):
            raise EngineError(f"{self.url}: update_weights_from_distributed failed: {reply.get('message')}")

    def close(self) -> None:
        import torch

        torch.distributed.destroy_process_group(self.group)


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
    ) -> None:
        self.engine, self.model_dir, self.work_dir, self.device = engine, model_dir, work_dir, device
        self.port = port or free_port(host)
        self.url = f"http://127.0.0.1:{self.port}"  # the cell and its server share a node
        self.cmd = sglang_command(engine, str(model_dir), self.port, host, python, device, gpu)
        self.log = work_dir / "sglang.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.group: WeightGroup | None = None
        self.layout = FlatLayout.of(Qwen3Config.load(model_dir))

    def start(self) -> int:
        """Launch and wait until healthy (and the weight group is formed); returns the port."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1") if self.device == "cpu" else None
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.engine.start_timeout_s
        while not call(self.url, lambda c: c.health(), timeout_s=5):
            if self.proc.poll() is not None:
                raise LaunchError(f"sglang exited with code {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                timeout = self.engine.start_timeout_s
                raise LaunchError(f"sglang not healthy after {timeout:g} s; see {self.log}")
            time.sleep(0.5)
        if self.engine.weight_sync == "broadcast":
            backend = "gloo" if self.device == "cpu" else "nccl"
            self.group = WeightGroup(self.url, self.layout, "127.0.0.1", self.engine.tp_size, backend)
        return self.port

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        call(self.url, lambda c: c.pause("abort"))

    def resume(self) -> None:
        call(self.url, lambda c: c.continue_())

    def release_memory(self) -> None:
        call(self.url, lambda c: c.release_memory())

    def resume_memory(self) -> None:
        call(self.url, lambda c: c.resume_memory())

    def load(self, flat: np.ndarray, version: int) -> None:
        """Serve ``flat`` as ``version`` from now on."""
        if self.group is None:  # engine.weight_sync = "disk"
            path = self.layout.save(flat, self.model_dir, self.work_dir / "weights")
            reply = call(self.url, lambda c: c.update_weights_from_disk(str(path), str(version)))
            if not reply.get("success"):
                raise EngineError(f"{self.url}: update_weights_from_disk failed: {reply.get('message')}")
            return
        call(self.url, lambda c: c.begin_weight_update())
        try:
            self.group.push(flat, version)
        finally:
            call(self.url, lambda c: c.end_weight_update())

    def stop(self) -> None:
        """Stop the server and every process it started (they share its session)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        _signal(self.proc.pid, signal.SIGKILL)  # its scheduler and detokenizer, whatever became of it
        self.proc.wait()
        if self.group is not None:
            self.group.close()
            self.group = None


def _signal(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
