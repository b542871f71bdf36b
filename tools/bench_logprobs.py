#!/usr/bin/env python3
"""Peak memory of one training micro-step with a large vocabulary: log-probs from whole logits
(the rule before ``loss.vocab_logprobs``: [tokens × vocabulary] float32 logits, their log-softmax
and its gradient) against log-probs in chunks of rows (``trainer.logprob_chunk``).

One path of ``--tokens`` tokens, every one a loss token, through the torch trainer (the tiny
model's shape with a ``--vocab`` vocabulary, tied embeddings, float32), forward and backward.
Each case runs in a fresh process whose resident set is read before the micro-step and at its
peak (``VmHWM``); where the cgroup-v1 memory controller is writable the process is held under
``--limit-gib`` so that a case which would not fit is killed there, not the machine. Reported side
by side: the micro-step's extra peak over what the process held before it, the bound the whole
logits need (tokens × vocabulary × 4 bytes, once), the time, and — at the smallest size — the
largest gradient difference between the two rules, relative to the gradient's largest entry.

    python tools/bench_logprobs.py [--tokens 4096,8192,32768] [--vocab 151936] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from gyre_hpc.loss.vocab_logprobs import full_logprobs
from gyre_hpc.models.catalog import tiny_config
from gyre_hpc.models.causal_lm import save_weights
from gyre_hpc.models.tiny import random_model
from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.sequences import TrainSequence

GIB = 1 << 30
CGROUP = Path("/sys/fs/cgroup/memory/gyre-bench-logprobs")


def build(directory: Path, vocab: int) -> Path:
    config = tiny_config(vocab, [0, 1])
    save_weights(random_model(config, 0), directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config.to_hf()))
    return directory


def trainer(model: Path, rule: str, chunk: int) -> TorchTrainer:
    t = TorchTrainer(model, TrainerConfig(logprob_chunk=chunk), core=False)
    if rule == "whole":  # the earlier rule: every row's logits, then one log-softmax over them
        weight = t.model.lm_head.weight
        t._head = lambda h, targets: full_logprobs(h @ weight.t(), targets)  # type: ignore[method-assign]
    return t


def path(tokens: int, vocab: int) -> list[TrainSequence]:
    rng = np.random.default_rng(0)
    ids = rng.integers(2, vocab, tokens)
    mask = np.ones(tokens, np.float32)
    return [TrainSequence("r", ids, mask, np.full(tokens, -5.0, np.float32), 1.0, 1.0 / tokens)]


def memory(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in bytes: kept per address
    space, unlike ``ru_maxrss``, which a process inherits from the one that started it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(model: Path, rule: str, tokens: int, vocab: int, chunk: int) -> dict:
    if CGROUP.exists():
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    t = trainer(model, rule, chunk)
    seqs = path(tokens, vocab)
    before = memory("VmRSS")
    start = time.perf_counter()
    t.micro_step(seqs)
    seconds = time.perf_counter() - start
    return {"extra": memory("VmHWM") - before, "seconds": seconds}


def gradient_gap(model: Path, tokens: int, vocab: int, chunk: int) -> float:
    grads = []
    for rule in ("whole", "chunked"):
        t = trainer(model, rule, chunk)
        t.micro_step(path(tokens, vocab))
        grads.append(t.gradient().copy())
    return float(np.abs(grads[0] - grads[1]).max() / np.abs(grads[0]).max())


def limit(gib: float) -> bool:
    """Hold the cases under ``gib`` (cgroup v1, as root); False where that cannot be done."""
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(int(gib * GIB)))
        swap = CGROUP / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(int(gib * GIB)))
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,8192,32768")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--limit-gib", type=float, default=18.0)
    p.add_argument("--child", nargs=3, metavar=("MODEL", "RULE", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        torch.set_num_threads(os.cpu_count() or 1)
        print(json.dumps(child(Path(a.child[0]), a.child[1], int(a.child[2]), a.vocab, a.chunk)))
        return
    console = Console()
    sizes = [int(x) for x in a.tokens.split(",")]
    held = limit(a.limit_gib)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp), a.vocab)
        gap = gradient_gap(model, min(sizes), a.vocab, a.chunk)
        table = Table(
            title=f"one micro-step, vocabulary {a.vocab:,}, chunk {a.chunk} rows (torch, float32, CPU)"
        )
        for column in ("tokens", "whole logits [T×V] fp32", "rule", "extra peak", "seconds"):
            table.add_column(column, justify="right")
        for tokens in sizes:
            for rule in ("whole", "chunked"):
                cmd = [sys.executable, __file__, "--vocab", str(a.vocab), "--chunk", str(a.chunk),
                       "--child", str(model), rule, str(tokens)]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode == 0:
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    peak, secs = f"{r['extra'] / GIB:.2f} GiB", f"{r['seconds']:.1f}"
                else:
                    where = f"under {a.limit_gib:g} GiB" if held else "on this machine"
                    peak, secs = f"out of memory {where} (rc {proc.returncode})", "—"
                bound = f"{tokens * a.vocab * 4 / GIB:.2f} GiB"
                table.add_row(f"{tokens:,}", bound, rule, peak, secs)
        console.print(table)
        console.print(f"gradients at {min(sizes):,} tokens: max |chunked − whole| / max |whole| = {gap:.2e}")
    if held:
        CGROUP.rmdir()


if __name__ == "__main__":
    main()
