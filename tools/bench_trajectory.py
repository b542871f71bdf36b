#!/usr/bin/env python3
"""Trajectory processing at the scale of one ultra-long run, measured on this machine.

A synthetic run of ~1M unique tokens over ~800 model calls — a main agent whose context grows
to ~750K tokens, a compaction, sub-agents with their own contexts and summaries — is encoded
call by call into the trajectory tree (what the proxy does as calls finish), written to disk,
read back and rebuilt (what the trainer does), and selected with Jmax.

    python tools/bench_trajectory.py [--calls 800] [--seed 0]

Targets (issue 3): build ≤ 2 s and ≤ 64 MiB resident for the run; disk ≤ 1.5 × (4 B × unique
tokens + 4 B × output tokens).
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from gyre_hpc.trajectory import TitoRecord, TrajectoryTree, select_paths
from gyre_hpc.trajectory.codec import read_records, write_records

VOCAB = 151_000


class SyntheticRun:
    """A long agent run as the proxy would record it (token ids only, deterministic)."""

    def __init__(self, seed: int, calls: int, context_limit: int = 750_000) -> None:
        self.rng = np.random.default_rng(seed)
        self.calls, self.limit = calls, context_limit
        self.system, self.task = self.tokens(2000), self.tokens(3000)
        self.sub_system, self.summarize = self.tokens(1500), self.tokens(60)
        self.n = 0

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, size=n, dtype=np.int32)

    def length(self, mean: int) -> int:
        return max(8, int(self.rng.exponential(mean)))

    def call(self, role: str, context: np.ndarray, out_mean: int) -> tuple[TitoRecord, np.ndarray]:
        out = self.tokens(self.length(out_mean))
        lp = -self.rng.exponential(0.5, size=len(out)).astype(np.float32)
        self.n += 1
        return TitoRecord("bench", f"c{self.n}", role, context, out, lp), out

    def __iter__(self) -> Iterator[TitoRecord]:
        context = np.concatenate([self.system, self.task])
        while self.n < self.calls:
            if self.n % 60 == 59:  # delegate to a sub-agent with its own context
                sub = np.concatenate([self.sub_system, self.tokens(400)])
                for _ in range(12):
                    record, out = self.call("sub-agent", sub, 200)
                    yield record
                    sub = np.concatenate([sub, out, self.tokens(self.length(800))])
                record, summary = self.call("sub-agent-summary", np.concatenate([sub, self.summarize]), 500)
                yield record
                context = np.concatenate([context, self.tokens(20), summary])  # the summary as a tool result
            if len(context) > self.limit:  # compaction: a summary replaces the history
                record, summary = self.call("main-summary", np.concatenate([context, self.summarize]), 2000)
                yield record
                context = np.concatenate([self.system, self.task, self.tokens(50), summary])
            record, out = self.call("main", context, 300)
            yield record
            context = np.concatenate([context, out, self.tokens(self.length(1000))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jmax", type=int, default=8)
    args = ap.parse_args()
    console = Console(width=110)

    tree = TrajectoryTree("bench")
    encode_s, inputs, outputs, roles = 0.0, 0, 0, {}
    with console.status("encoding the run call by call…"):
        for record in SyntheticRun(args.seed, args.calls):
            t0 = time.perf_counter()
            tree.add(record)
            encode_s += time.perf_counter() - t0
            inputs += len(record.input_ids)
            outputs += len(record.output_ids)
            roles[record.role] = roles.get(record.role, 0) + 1
    unique, records = tree.num_unique_tokens, tree.num_record_tokens

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tito.bin"
        t0 = time.perf_counter()
        size = write_records(path, tree.encoded)
        write_s = time.perf_counter() - t0
        del tree
        t0 = time.perf_counter()
        read = read_records(path)
        rebuilt = TrajectoryTree.from_encoded(read.records)
        rebuild_s = time.perf_counter() - t0
        del read, rebuilt
        tracemalloc.start()
        read = read_records(path)
        rebuilt = TrajectoryTree.from_encoded(read.records)
        del read
        resident = tracemalloc.get_traced_memory()[0]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    with console.status("verifying every record read back against the generator…"):
        exact = all(
            a == b for a, b in zip(SyntheticRun(args.seed, args.calls), rebuilt.records(), strict=True)
        )
    t0 = time.perf_counter()
    chosen = select_paths(rebuilt, jmax=args.jmax, rng=random.Random(args.seed))
    select_s = time.perf_counter() - t0

    budget = 1.5 * (4 * unique + 4 * outputs)
    mib = 1 << 20
    table = Table(
        title=f"trajectory processing: one synthetic run, {rebuilt.num_records} calls", show_lines=False
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    rows = [
        ("calls by role", ", ".join(f"{k} {v}" for k, v in roles.items()), ""),
        ("record tokens (input + output, flat)", f"{records:,}", ""),
        ("unique tokens (tree)", f"{unique:,}", "≈ 1M"),
        ("dedup ratio", f"{records / unique:.0f}×", ""),
        ("trainable tokens", f"{rebuilt.num_trainable_tokens:,}", ""),
        ("leaves / nodes", f"{len(rebuilt.leaves())} / {len(rebuilt.nodes)}", ""),
        ("encode + build (call by call)", f"{encode_s:.2f} s", "≤ 2 s"),
        ("write to disk", f"{write_s * 1000:.0f} ms", ""),
        ("read back + rebuild", f"{rebuild_s:.2f} s", "≤ 2 s"),
        ("resident: tree rebuilt from disk", f"{resident / mib:.1f} MiB", "≤ 64 MiB"),
        ("peak while reading + rebuilding", f"{peak / mib:.1f} MiB", "≤ 64 MiB"),
        (
            f"select Jmax={args.jmax}",
            f"{select_s * 1000:.0f} ms ({len(chosen)} paths, "
            f"{sum(p.num_loss_tokens for p in chosen):,} loss tokens)",
            "",
        ),
        ("bytes on disk", f"{size:,} ({size / unique:.2f} B/unique token)", f"≤ {budget:,.0f}"),
        ("records read back exactly", "yes" if exact else "NO", "yes"),
        (
            "process max RSS (incl. Python, NumPy, generator)",
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB",
            "",
        ),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    ok = exact and encode_s <= 2 and rebuild_s <= 2 and peak <= 64 * mib and size <= budget
    console.print("[green]all targets met[/]" if ok else "[red]a target was missed[/]")


if __name__ == "__main__":
    main()
