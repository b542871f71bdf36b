"""The one way out of a sandbox: the proxy, relayed over a Unix socket.

```
 sandbox (no network)                                        host
   harness ──TCP──▶ 127.0.0.1:P ─ inside() ─▶ /run/gyre/proxy.sock ═bind═ outside() ──TCP──▶ proxy
```

A command harness's program starts under ``inside`` (run as ``python -I relay.py SOCKET PORT --
PROGRAM …``): it listens on the sandbox's loopback, forwards each connection to the socket bound
in, and exits with the program's exit code. ``outside`` is the socket's host end, one per
execution, forwarding to the proxy's address. Nothing else is reachable: the sandbox has no
other interface. Inside a sandbox this file runs on its own, so it imports only the standard
library.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
CHUNK = 1 << 16


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        dst.close()


def _bridge(connect: Connect) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await connect()
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except asyncio.CancelledError:  # the relay is closing: the connection goes with it
            writer.close()
            up_writer.close()

    return serve


@contextlib.asynccontextmanager
async def outside(host: str, port: int, owner: int | None) -> AsyncIterator[Path]:
    """A Unix socket forwarding to ``host:port`` while the block runs; owned by ``owner`` (the
    sandbox's uid, when the runtime is root) so that only the sandbox and the runtime may use it."""
    with tempfile.TemporaryDirectory(prefix="gyre-proxy-") as tmp:  # short: socket paths are ≤ 107 bytes
        path = Path(tmp) / "proxy.sock"
        server = await asyncio.start_unix_server(_bridge(lambda: asyncio.open_connection(host, port)), path)
        os.chmod(path, 0o600)
        if owner is not None:
            os.chown(path, owner, owner)
        try:
            yield path
        finally:
            server.close()


async def listen(socket: str | Path, port: int) -> asyncio.Server:
    """Forward ``127.0.0.1:port`` (0: any free port) to the Unix ``socket``."""
    forward = _bridge(lambda: asyncio.open_unix_connection(socket))
    return await asyncio.start_server(forward, "127.0.0.1", port)


async def inside(socket: str, port: int, program: list[str]) -> int:
    """Serve ``127.0.0.1:port`` → ``socket`` while ``program`` runs; its exit code."""
    server = await listen(socket, port)
    try:
        proc = await asyncio.create_subprocess_exec(*program)
    except OSError as err:
        print(f"relay: {program[0]}: {err.strerror or err}", file=sys.stderr)
        return 127
    code = await proc.wait()
    server.close()
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def main(args: list[str]) -> int:
    if len(args) < 4 or args[2] != "--":
        print("usage: relay.py SOCKET PORT -- PROGRAM [ARG …]", file=sys.stderr)
        return 2
    return asyncio.run(inside(args[0], int(args[1]), args[3:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
