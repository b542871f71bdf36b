#!/usr/bin/env python3
"""The embedded engine on this machine: batched decoding, prefix caching, KV migration.

    python tools/bench_engine.py [--model DIR]

1. decode throughput at 1 / 8 / 32 concurrent requests (continuous batching);
2. prefix-cache hit ratio over a 50-turn conversation that resends its whole context
   (goal ≥ 0.9 of prompt tokens cached);
3. moving a request with a 4K-token context to another engine (export, pull, import) against
   recomputing that context there, side by side.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gyre_hpc.engines.embedded import Engine
from gyre_hpc.engines.sampling import SamplingParams
from gyre_hpc.models.tiny import init_tiny


def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    results: list[dict] = []
    done = threading.Event()

    def on_done(r: dict) -> None:
        results.append(r)
        if len(results) == len(prompts):
            done.set()

    for p in prompts:
        engine.submit(p, params, on_done)
    done.wait()
    return results


def decode_throughput(model: Path) -> list[tuple[int, float, float]]:
    rows = []
    for concurrency in (1, 8, 32):
        engine = Engine(model, max_running=64).start()
        prompts = [[10 + (i * 7 + j) % 800 for j in range(64)] for i in range(concurrency)]
        params = SamplingParams(max_new_tokens=128, ignore_eos=True, sampling_seed=0)
        generate_all(engine, prompts[:1], SamplingParams(max_new_tokens=4))  # warm up
        t0 = time.perf_counter()
        generate_all(engine, prompts, params)
        seconds = time.perf_counter() - t0
        engine.stop()
        rows.append((concurrency, concurrency * 128 / seconds, seconds))
    return rows


def cache_hit_ratio(model: Path, turns: int = 50) -> tuple[float, int, int]:
    engine = Engine(model).start()
    tok = engine.tokenizer
    ids = tok.encode(
        tok.render(
            [
                {"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "Build the package from the spec."},
            ]
        )
    )
    prompt_tokens = cached = 0
    for turn in range(turns):
        (out,) = generate_all(
            engine, [ids], SamplingParams(max_new_tokens=24, ignore_eos=True, sampling_seed=turn)
        )
        prompt_tokens += out["meta_info"]["prompt_tokens"]
        cached += out["meta_info"]["cached_tokens"]
        ids = (
            ids
            + out["output_ids"]
            + tok.encode(
                f"\n<|im_start|>user\n<tool_response>\nresult {turn}: ok\n"
                "</tool_response><|im_end|>\n<|im_start|>assistant\n"
            )
        )
    engine.stop()
    return cached / prompt_tokens, cached, prompt_tokens


def migrate_vs_recompute(model: Path, context: int = 4096) -> tuple[float, float, int, int]:
    source, dest, fresh = Engine(model).start(), Engine(model).start(), Engine(model, cache_tokens=0).start()
    prompt = [10 + i % 800 for i in range(context)]
    seq = source.submit(
        prompt, SamplingParams(max_new_tokens=10**6, ignore_eos=True), lambda r: None, rid="m"
    )
    while len(seq.output_ids) < 4:
        time.sleep(0.01)
    t0 = time.perf_counter()
    handle, n = source.export_kv("m")
    data = source.pinned[handle]
    dest.import_kv(data)
    source.release_kv(handle)
    tokens = seq.tokens[: n + 1]
    (moved,) = generate_all(dest, [tokens], SamplingParams(max_new_tokens=1, temperature=0))
    migrate_s = time.perf_counter() - t0
    source.abort("m")
    t0 = time.perf_counter()
    (again,) = generate_all(fresh, [tokens], SamplingParams(max_new_tokens=1, temperature=0))
    recompute_s = time.perf_counter() - t0
    for e in (source, dest, fresh):
        e.stop()
    assert moved["meta_info"]["cached_tokens"] == n and again["meta_info"]["cached_tokens"] == 0
    return migrate_s, recompute_s, n, len(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: a fresh tiny model)")
    args = ap.parse_args()
    console = Console(width=110)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or init_tiny(Path(tmp) / "tiny")
        with console.status("decoding…"):
            throughput = decode_throughput(model)
        with console.status("50-turn conversation…"):
            ratio, cached, prompt = cache_hit_ratio(model)
        with console.status("migrating a 4K context…"):
            migrate_s, recompute_s, n, nbytes = migrate_vs_recompute(model)
    t = Table(title=f"embedded engine, {model.name}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("goal", justify="right")
    for c, tps, s in throughput:
        t.add_row(f"decode, {c} concurrent × 128 tokens", f"{tps:,.0f} tokens/s ({s:.2f} s)", "")
    t.add_row("batching speed-up 32 vs 1", f"{throughput[2][1] / throughput[0][1]:.1f}×", "")
    t.add_row(
        "prefix cache, 50-turn conversation", f"{ratio:.3f} ({cached:,} of {prompt:,} prompt tokens)", "≥ 0.9"
    )
    t.add_row(
        f"move {n:,}-token KV ({nbytes / 2**20:.1f} MiB) + next token", f"{migrate_s * 1000:.0f} ms", ""
    )
    t.add_row("recompute the same context + next token", f"{recompute_s * 1000:.0f} ms", "")
    t.add_row("migrate / recompute", f"{migrate_s / recompute_s:.2f}", "< 1")
    console.print(t)


if __name__ == "__main__":
    main()
