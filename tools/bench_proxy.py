#!/usr/bin/env python3
"""The proxy's own cost per model call, measured side by side with direct engine calls.

Both sides drive the same engine: a null engine that answers ``/generate`` after a fixed
delay (standing in for decoding) with a fixed reply, so what differs between the columns is
the proxy — key check, chat rendering and exact-id reuse, routing, the extra HTTP hop, TITO
encoding and group commit (write + fsync before the reply). The proxy runs in its own
process (``gyre-hpc proxy serve``), as in production. ``R`` concurrent runs each make ``T``
calls of a growing multi-turn chat, with a think time between calls (the harness running
tools). Reported per call: client-side latency percentiles, direct vs through the proxy, and
the proxy's own time as it reports it (``X-Gyre-Proxy-Ms``: everything but waiting for the
engine).

    python tools/bench_proxy.py [--runs 64 256] [--turns 8] [--engine-ms 20] [--think-ms 200]
        [--workers 1 2 4]

``--workers``: the proxy as that many processes, each serving the runs of its shard
(``run_shard``) into its own TITO segment, as ``proxy.workers`` runs it; one table row per
worker count and number of runs, with the calls per second served through the proxy. The CPU
each call costs (the proxies', and this process's: the runs' client side and the null engine)
gives the bound no number of workers can pass on this machine: cores / CPU per call.

Goal: the proxy's own p99 ≤ 2 ms at 64 runs and ≤ 5 ms at 256 runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table

from gyre_hpc.launch.ports import free_port
from gyre_hpc.models.tiny import init_tiny
from gyre_hpc.models.tokenizer import ChatTokenizer
from gyre_hpc.proxy.keys import KeyRing
from gyre_hpc.proxy.run_shard import shard_of
from gyre_hpc.rundir import RunDir

REPLY = "I will run the tests now.<|im_end|>"


def null_engine(reply_ids: list[int], delay_s: float) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(delay_s)
        return web.json_response(
            {
                "text": "",
                "output_ids": reply_ids,
                "meta_info": {
                    "id": body.get("rid"),
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(reply_ids),
                    "cached_tokens": 0,
                    "finish_reason": {"type": "stop", "matched": reply_ids[-1]},
                    "weight_version": "0",
                    "output_token_logprobs": [[-0.5, t, None] for t in reply_ids],
                },
            }
        )

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"tokenizer_path": request.app["model"]})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_model_info", info)
    return app


def cpu_s(pids: list[int]) -> float:
    """CPU seconds these processes have used (user + system), from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def drive(runs: int, turns: int, think_s: float, call) -> list[float]:  # noqa: ANN001
    latencies: list[float] = []
    rng = random.Random(0)

    async def one_run(r: int) -> None:
        await asyncio.sleep(rng.random() * think_s)  # runs do not start in lock step
        messages = [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": f"task {r}"},
        ]
        for t in range(turns):
            t0 = time.perf_counter()
            reply = await call(r, messages)
            latencies.append((time.perf_counter() - t0) * 1000)
            messages = messages + [reply, {"role": "user", "content": f"tool output {t} " * 8}]
            await asyncio.sleep(think_s * (0.5 + rng.random()))

    await asyncio.gather(*(one_run(r) for r in range(runs)))
    return latencies


async def bench(args: argparse.Namespace, model: Path, run_dir: Path) -> list[tuple]:
    tok = ChatTokenizer(model)
    app = null_engine(tok.encode(REPLY), args.engine_ms / 1000)
    app["model"] = str(model)
    runner = web.AppRunner(app)
    await runner.setup()
    engine_port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    engine_url = f"http://127.0.0.1:{engine_port}"
    rows = []
    try:
        for workers in args.workers:
            rows += await bench_workers(args, model, run_dir / f"w{workers}", tok, engine_url, workers)
    finally:
        await runner.cleanup()
    return rows


async def bench_workers(
    args: argparse.Namespace, model: Path, run_dir: Path, tok: ChatTokenizer, engine_url: str, workers: int
) -> list[tuple]:
    run_dir.mkdir()
    keys = KeyRing.load(RunDir(run_dir).proxy_secret)  # before the workers: one secret for all
    ports = [free_port("127.0.0.1") for _ in range(workers)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gyre_hpc",
                "proxy",
                "serve",
                "--engine",
                engine_url,
                "--run-dir",
                str(run_dir),
                "--model",
                str(model),
                "--port",
                str(port),
                # as many calls in flight as the direct side has: only the proxy differs
                "--capacity",
                str(-(-4096 // workers)),
                "--worker",
                str(i),
                "--workers",
                str(workers),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for i, port in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    rows = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for proxy_url in urls:
                for _ in range(300):
                    try:
                        async with session.get(proxy_url + "/health"):
                            break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.1)
            overheads: list[float] = []

            async def direct(r: int, messages: list[dict]) -> dict:
                ids = tok.encode(tok.render(messages))  # what a harness without the proxy would do
                async with session.post(
                    engine_url + "/generate",
                    json={
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 16},
                        "return_logprob": True,
                    },
                ) as resp:
                    await resp.json()
                return {"role": "assistant", "content": "I will run the tests now."}

            async def via_proxy(r: int, messages: list[dict]) -> dict:
                run_id = f"{label}-{r}"
                headers = {"Authorization": f"Bearer {keys.mint(run_id, 'main')}"}
                async with session.post(
                    urls[shard_of(run_id, workers)] + "/v1/chat/completions",
                    headers=headers,
                    json={"messages": messages, "max_tokens": 16},
                ) as resp:
                    body = await resp.json()
                    overheads.append(float(resp.headers["X-Gyre-Proxy-Ms"]))
                return body["choices"][0]["message"]

            label = "warm"
            await drive(8, 2, 0.01, via_proxy)
            if args.hostile and workers == 1:
                label = "alone"
                alone = await drive(args.hostile_runs, args.turns, args.think_ms / 1000, via_proxy)
                label = "attacked"
                attacked, bad = await under_attack(session, urls[0], keys, args, via_proxy)
                rows.append(("hostile", alone, attacked, bad))
            for runs in args.runs:
                label, overheads = f"r{runs}", []
                d = await drive(runs, args.turns, args.think_ms / 1000, direct)
                started, cpu = time.perf_counter(), (cpu_s([q.pid for q in procs]), time.process_time())
                p = await drive(runs, args.turns, args.think_ms / 1000, via_proxy)
                calls_per_s = len(p) / (time.perf_counter() - started)
                proxy_ms = 1000 * (cpu_s([q.pid for q in procs]) - cpu[0]) / len(p)
                here_ms = 1000 * (time.process_time() - cpu[1]) / len(p)  # the runs and the engine
                rows.append(
                    (
                        workers,
                        runs,
                        len(p),
                        pct(d, 0.5),
                        pct(p, 0.5),
                        pct(d, 0.99),
                        pct(p, 0.99),
                        pct(p, 0.99) - pct(d, 0.99),
                        pct(overheads, 0.5),
                        pct(overheads, 0.99),
                        proxy_ms,
                        here_ms,
                        calls_per_s,
                        (os.cpu_count() or 1) * 1000 / (proxy_ms + here_ms),
                    )
                )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    return rows


BAD_BODIES: dict[str, list[object]] = {
    "not JSON": [b"{", b"\xff\xfe", b"[1, 2]"],
    "messages of the wrong shape": [
        {"messages": []},
        {"messages": [{"role": "user", "content": 7}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]},
    ],
    "sampling out of range": [
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        {"messages": [{"role": "user", "content": "x"}], "top_p": 5},
        {"messages": [{"role": "user", "content": "x"}], "seed": "x"},
    ],
    "far beyond the context (3 MB)": [{"messages": [{"role": "user", "content": "word " * 600_000}]}],
    "a 10 MB tool description": [
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "description": "word " * (2 << 20)}}],
        }
    ],
    "nested 10,000 deep": [b"[" * 10_000 + b"]" * 10_000],
}


async def under_attack(session, url: str, keys: KeyRing, args, via_proxy):  # noqa: ANN001, ANN201
    """Normal runs while ``args.attackers`` clients send nothing but bad requests."""
    key = keys.mint("attacker", "main")
    bad: dict[str, list[tuple[int, float]]] = {}
    stop = asyncio.Event()

    # Encoded once: the attackers' own cost must not count against the proxy (2 shared cores).
    bodies = {
        c: [b if isinstance(b, bytes) else json.dumps(b).encode() for b in bs] for c, bs in BAD_BODIES.items()
    }
    bodies["bad key"] = [json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()]

    async def attacker(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            category = rng.choice(list(bodies))
            auth = "Bearer gy-\u00e9" if category == "bad key" else f"Bearer {key}"
            headers = {"Authorization": auth, "Content-Type": "application/json"}
            t0 = time.perf_counter()
            data = rng.choice(bodies[category])
            async with session.post(url + "/v1/chat/completions", data=data, headers=headers) as resp:
                await resp.read()
                bad.setdefault(category, []).append((resp.status, (time.perf_counter() - t0) * 1000))

    tasks = [asyncio.create_task(attacker(i)) for i in range(args.attackers)]
    try:
        normal = await drive(args.hostile_runs, args.turns, args.think_ms / 1000, via_proxy)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return normal, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--engine-ms", type=float, default=20.0)
    ap.add_argument("--think-ms", type=float, default=200.0)
    ap.add_argument("--hostile", action="store_true", help="Also: normal calls alone vs under bad requests.")
    ap.add_argument("--hostile-runs", type=int, default=16)
    ap.add_argument("--attackers", type=int, default=4, help="Clients sending only bad requests.")
    ap.add_argument("--workers", type=int, nargs="+", default=[1], help="Proxy processes (one row set each).")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny")
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        rows = asyncio.run(bench(args, model, run_dir))
    table = Table(
        title=f"per-call latency (ms): null engine {args.engine_ms:g} ms, think {args.think_ms:g} ms, "
        f"{os.cpu_count()} cores shared by load, proxy and engine"
    )
    for col in (
        "workers",
        "runs",
        "calls",
        "direct p50",
        "proxy p50",
        "direct p99",
        "proxy p99",
        "Δ p99",
        "proxy's own p50",
        "proxy's own p99",
        "proxy CPU ms/call",
        "runs+engine CPU ms/call",
        "calls/s",
        "cores bound calls/s",
    ):
        table.add_column(col, justify="right")
    console = Console(width=200)
    for row in rows:
        if row[0] != "hostile":
            table.add_row(
                *(str(v) for v in row[:3]), *(f"{v:.2f}" for v in row[3:-2]), *(f"{v:.0f}" for v in row[-2:])
            )
    console.print(table)
    for _, alone, attacked, bad in (r for r in rows if r[0] == "hostile"):
        title = f"{args.hostile_runs} normal runs, alone and while {args.attackers} clients send bad requests"
        hostile = Table(title=title)
        for col in ("requests", "count", "status codes", "p50 ms", "p99 ms", "max ms"):
            hostile.add_column(col, justify="right")
        for name, lat in (("normal, alone", alone), ("normal, under attack", attacked)):
            hostile.add_row(
                name, str(len(lat)), "200", f"{pct(lat, 0.5):.2f}", f"{pct(lat, 0.99):.2f}", f"{max(lat):.2f}"
            )
        for category, results in sorted(bad.items()):
            codes = ", ".join(f"{c}×{n}" for c, n in sorted(Counter(s for s, _ in results).items()))
            lat = [t for _, t in results]
            hostile.add_row(
                category,
                str(len(lat)),
                codes,
                f"{pct(lat, 0.5):.2f}",
                f"{pct(lat, 0.99):.2f}",
                f"{max(lat):.2f}",
            )
        console.print(hostile)
        console.print(
            f"normal p50 under attack / alone: {pct(attacked, 0.5) / pct(alone, 0.5):.2f}×, "
            f"p99: {pct(attacked, 0.99) / pct(alone, 0.99):.2f}×"
        )


if __name__ == "__main__":
    main()
