"""The SGLang backend: launch ``python -m sglang.launch_server`` for a cell and wait until healthy.

The command is a pure function of the engine config (golden-tested); once up, the server is
driven by the same ``EngineClient`` as the embedded engine, including the
``begin_weight_update`` … ``end_weight_update`` session SGLang 0.5.23 requires.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from gyre_hpc.engines.client import EngineClient
from gyre_hpc.errors import LaunchError
from gyre_hpc.recipe.schema import EngineConfig


def sglang_command(
    engine: EngineConfig, model: str, port: int, host: str = "127.0.0.1", python: str = sys.executable
) -> list[str]:
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(engine.tp_size),
        "--mem-fraction-static",
        str(engine.mem_fraction_static),
        "--weight-version",
        "0",
        "--skip-server-warmup",
    ]
    if engine.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if engine.max_total_tokens:
        cmd += ["--max-total-tokens", str(engine.max_total_tokens)]
    return cmd


class SGLangServer:
    """One SGLang server process (a cell's sampling service on GPUs)."""

    def __init__(
        self, engine: EngineConfig, model: str, port: int, log: Path, host: str = "127.0.0.1"
    ) -> None:
        self.cmd = sglang_command(engine, model, port, host)
        self.url = f"http://{host}:{port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 900.0) -> EngineClient:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        client = EngineClient(self.url)
        deadline = time.monotonic() + timeout_s
        while not asyncio.run(_healthy(self.url)):
            if self.proc.poll() is not None:
                raise LaunchError(f"sglang exited with code {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"sglang not healthy after {timeout_s:g} s; see {self.log}")
            time.sleep(2)
        return client

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _healthy(url: str) -> bool:
    async with EngineClient(url, timeout_s=5) as client:
        return await client.health()
