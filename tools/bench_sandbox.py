#!/usr/bin/env python3
"""The sandbox's cost: per tool command, and per model call of a sandboxed command harness.

Commands: ``N`` trivial commands (``true``) run exactly as a ``run_shell`` tool call runs them
(``Workspace.run``: the execution's limits group, its output streamed, the workspace's quota
watched, scrubbed environment), unconfined and in the bwrap sandbox (with its seccomp filter),
interleaved so that every row sees the same machine. They are started from a process as large
as the runtime's controller (``--resident-mb``; the smoke run's rank 0 holds about 430 MB),
since that is what a tool call's spawn starts from. The floor is a bare spawn of ``bash`` from
that process; one more row, measured apart, sets the limits the way tool calls once did, in
Python between fork and exec (``preexec_fn``), which forks the whole process instead of
vfork-ing it. The difference between the two tool-call rows is the sandbox's namespaces and
mounts.

Calls: ``M`` sequential HTTP requests to a loopback server, direct and through the relay pair
(``sandbox.relay``: the sandbox's loopback → Unix socket → the proxy's port), the way a
sandboxed harness reaches the proxy. Both ends of the relay run here, outside a sandbox: the
hop is what is measured.

    python tools/bench_sandbox.py [--commands 100] [--calls 200] [--resident-mb 430] [--attacks]

Goal: ≤ 20 ms per command.

``--attacks`` also runs what one execution could do to the host, each as a ``run_shell`` call in
a sandboxed execution with its own limits group (the defaults but a 256 MiB workspace quota):
a fork bomb, four processes of 1.5 GiB, a 2 GB print and a disk flood; it prints how each ended,
in what time, and how much this process (the runtime) grew meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table

from gyre_hpc.agents.workspace import Workspace
from gyre_hpc.recipe.schema import AgentConfig
from gyre_hpc.sandbox import relay
from gyre_hpc.sandbox.confine import FILE_SIZE_BYTES, Sandbox


def _limits_in_child() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (11, 11))
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_BYTES, FILE_SIZE_BYTES))


def commands(n: int, resident_mb: int) -> dict[str, list[float]]:
    box = Sandbox.from_config(AgentConfig(sandbox="bwrap"), (), print)  # and the execution limits
    bare_box = Sandbox.from_config(AgentConfig(sandbox="none"), (), print)
    ballast = bytearray(b"\x01") * (resident_mb << 20)  # resident pages, as the runtime's are
    bash = ["bash", "-c", "true"]
    pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "start_new_session": True}
    with (
        tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp,
        box.group("bench") as group,
        bare_box.group("bench-none") as bare_group,
    ):
        box.prepare(Path(tmp), group)
        # As the harness runs them: each execution's commands in its limits group.
        none, boxed = Workspace(Path(tmp), bare_box, group=bare_group), Workspace(Path(tmp), box, group=group)
        ways: dict[str, Callable[[], int]] = {
            "bare": lambda: subprocess.run(bash, **pipes).returncode,
            "none": lambda: none.run("true", 10).exit_code,
            "bwrap": lambda: boxed.run("true", 10).exit_code,
        }
        times: dict[str, list[float]] = {kind: [] for kind in ways}
        for way in ways.values():
            way()  # first spawn: page cache, not the sandbox
        for _ in range(n):
            for kind, way in ways.items():
                started = time.perf_counter()
                code = way()
                times[kind].append(time.perf_counter() - started)
                assert code == 0, kind
        # Apart: a fork of the whole process leaves its pages copy-on-write, and whatever runs next
        # in this process pays to take them back (13 ms measured), which would be charged to the
        # next row.
        times["preexec"] = []
        for _ in range(n):
            started = time.perf_counter()
            assert subprocess.run(bash, **pipes, preexec_fn=_limits_in_child).returncode == 0
            times["preexec"].append(time.perf_counter() - started)
    del ballast
    return times


async def calls(m: int) -> dict[str, list[float]]:
    app = web.Application()
    app.router.add_get("/", lambda request: web.json_response({"object": "chat.completion"}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    times: dict[str, list[float]] = {"direct": [], "relay": []}
    async with relay.outside("127.0.0.1", port, None) as sock:
        inner = await relay.listen(sock, 0)
        inner_port = inner.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as session:
            for _ in range(m):
                for kind, p in (("direct", port), ("relay", inner_port)):
                    started = time.perf_counter()
                    async with session.get(f"http://127.0.0.1:{p}/") as resp:
                        await resp.read()
                    times[kind].append(time.perf_counter() - started)
        inner.close()
    await runner.cleanup()
    return times


ATTACKS = {
    "fork bomb": ("bomb() { bomb | bomb & }; bomb; sleep 30", 5),
    "4 × 1.5 GiB": ("for i in 1 2 3 4; do python3 -c 'import time; b = b\"x\" * (1536 << 20); "
                    "time.sleep(3)' & done; wait", 60),
    "2 GB printed": ("head -c 2000000000 /dev/zero | tr '\\0' x", 120),
    "disk flood (12 × 64 MiB)": ("for i in $(seq 12); do head -c 64M /dev/zero > f$i; done", 60),
}  # fmt: skip


def attacks() -> Table:
    config = AgentConfig(sandbox="bwrap", workspace_mb=256, memory_mb=2048, command_output_mb=4096)
    box = Sandbox.from_config(config, (), print)
    table = Table(title=f"one execution against the host (limits: {box.groups.kind})")
    for col in ("attack", "how it ended", "seconds", "runtime grew MB", "limit events", "workspace MB"):
        table.add_column(col, justify="left" if col in ("attack", "how it ended") else "right")
    for name, (line, timeout) in ATTACKS.items():
        with tempfile.TemporaryDirectory(prefix="gyre-attack-") as tmp, box.group("attack") as group:
            Path(tmp).chmod(0o755)
            box.prepare(Path(tmp), group)
            Path("/proc/self/clear_refs").write_text("5\n")  # the peak, down to what is resident now
            before = _peak_mb()
            started = time.perf_counter()
            result = Workspace(Path(tmp), box, group=group).run(line, timeout)
            seconds = time.perf_counter() - started
            grew = _peak_mb() - before
            how = f"killed: {result.killed}" if result.killed else f"exit code {result.exit_code}"
            events = ", ".join(f"{k} {v}" for k, v in group.events().items() if v) or "-"
            held = sum(f.stat().st_size for f in Path(tmp).iterdir() if f.is_file()) / 2**20
            table.add_row(name, how[:90], f"{seconds:.1f}", f"{grew:.0f}", events, f"{held:.0f}")
    return table


def _peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024


def row(times: list[float]) -> list[str]:
    ms = sorted(t * 1e3 for t in times)
    p99 = ms[int(0.99 * (len(ms) - 1))]
    return [f"{statistics.median(ms):.2f}", f"{statistics.fmean(ms):.2f}", f"{p99:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--resident-mb", type=int, default=430, help="the spawning process's size")
    parser.add_argument("--attacks", action="store_true", help="also: what one execution does to the host")
    args = parser.parse_args()
    console = Console(width=150)
    if args.attacks:
        with console.status("attacks …"):
            console.print(attacks())
    with console.status("commands …"):
        cmd = commands(args.commands, args.resident_mb)
    with console.status("calls …"):
        http = asyncio.run(calls(args.calls))
    title = f"per tool command ({args.commands} × `true`, interleaved, from {args.resident_mb} MB resident)"
    table = Table(title=title)
    for col in ("", "p50 ms", "mean ms", "p99 ms"):
        table.add_column(col, justify="right")
    table.add_row("bare spawn of bash (the floor)", *row(cmd["bare"]))
    table.add_row("limits by preexec_fn (forks the process)", *row(cmd["preexec"]))
    table.add_row("tool call, unconfined", *row(cmd["none"]))
    table.add_row("tool call, bwrap sandbox", *row(cmd["bwrap"]))
    over = statistics.median(cmd["bwrap"]) - statistics.median(cmd["none"])
    table.add_row("sandbox overhead (p50 difference)", f"{over * 1e3:.2f}", "", "")
    console.print(table)
    table = Table(title=f"per model call of a sandboxed harness ({args.calls} sequential HTTP GETs)")
    for col in ("", "p50 ms", "mean ms", "p99 ms"):
        table.add_column(col, justify="right")
    table.add_row("direct", *row(http["direct"]))
    table.add_row("through the relay", *row(http["relay"]))
    console.print(table)
    ratio = statistics.median(cmd["bwrap"]) / statistics.median(cmd["none"])
    floor = statistics.median(cmd["bwrap"]) / statistics.median(cmd["bare"])
    console.print(
        f"sandboxed / unconfined: {ratio:.2f}×; {over * 1e3:.2f} ms more a command (goal ≤ 20 ms); "
        f"sandboxed / bare spawn: {floor:.2f}×"
    )


if __name__ == "__main__":
    main()
