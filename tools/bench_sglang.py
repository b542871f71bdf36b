#!/usr/bin/env python3
"""A new weight version into a real SGLang server: one broadcast of the flat snapshot against a
model directory on disk, per GB, side by side in one run.

    .venv-sglang/bin/python tools/bench_sglang.py [--size 1.2gb] [--repeats 3] [--json OUT]

The model is a Qwen3-shaped network with random float32 weights (the tiny model's tokenizer),
served at float32 on this machine's CPU. ``broadcast`` is what a cell does by default
(``engine.weight_sync = "broadcast"``): begin_weight_update → the leader broadcasts the whole
flat buffer over a gloo group it formed with the server → end_weight_update. ``disk`` writes the
buffer as a Hugging Face directory and calls update_weights_from_disk. The bound printed beside
them is one in-memory copy of the same buffer.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_hpc.engines.sglang import SGLangServer, call  # noqa: E402
from gyre_hpc.models.flat import FlatLayout  # noqa: E402
from gyre_hpc.models.qwen3 import Qwen3Config  # noqa: E402
from gyre_hpc.models.tiny import init_tiny  # noqa: E402
from gyre_hpc.recipe.schema import EngineConfig  # noqa: E402

SIZES = {
    "tiny": {},
    # ≈ 0.30 B parameters, 1.2 GB at float32.
    "1.2gb": dict(
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=128,
    ),
}


def write_model(size: str, root: Path) -> tuple[Path, np.ndarray]:
    model_dir = init_tiny(root / "model", seed=0)  # tokenizer, template, a config to widen
    base = Qwen3Config.load(model_dir)
    config = replace(base, **SIZES[size])
    layout = FlatLayout.of(config)
    flat = np.random.default_rng(0).standard_normal(layout.numel, dtype=np.float32) * np.float32(0.02)
    (model_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    layout.save(flat, model_dir, model_dir)  # the weights over the tiny ones, in place
    return model_dir, flat


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="1.2gb")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, flat = write_model(args.size, Path(tmp))
        gb = flat.nbytes / 1e9
        engine = EngineConfig(backend="sglang", dtype="float32", max_total_tokens=4096)
        server = SGLangServer(engine, model_dir, Path(tmp) / "sglang", device="cpu")
        t0 = time.perf_counter()
        server.start()
        start_s = time.perf_counter() - t0
        try:
            version = iter(range(1, 1000))
            broadcast = timed(lambda: server.load(flat, next(version)), args.repeats)
            group, server.group = server.group, None  # the disk path, same server
            disk = timed(lambda: server.load(flat, next(version)), args.repeats)
            server.group = group
            write = timed(lambda: server.layout.save(flat, model_dir, Path(tmp) / "write-only"), args.repeats)
            served = call(server.url, lambda c: c.generate([1, 2, 3], {"max_new_tokens": 1}))["meta_info"]
            copy = np.empty_like(flat)
            bound = timed(lambda: np.copyto(copy, flat), args.repeats)
        finally:
            server.stop()
    figures = {
        "size_gb": round(gb, 3),
        "server_start_s": round(start_s, 1),
        "broadcast_s": round(broadcast, 3),
        "broadcast_gb_per_s": round(gb / broadcast, 2),
        "disk_s": round(disk, 3),
        "disk_gb_per_s": round(gb / disk, 2),
        "disk_write_s": round(write, 3),
        "memcpy_gb_per_s": round(gb / bound, 2),
        "last_version_served": served["weight_version"],
    }
    print(f"{args.size}: {gb:.2f} GB of float32 weights into one SGLang server (CPU, gloo)")
    print(f"  broadcast (begin → one flattened bucket → end): {broadcast:.3f} s = {gb / broadcast:.2f} GB/s")
    print(f"  disk (write a model directory + update_weights_from_disk): {disk:.3f} s = {gb / disk:.2f} GB/s"
          f" (of which writing {write:.3f} s)")  # fmt: skip
    print(f"  broadcast is {disk / broadcast:.2f}× faster; the bound, one memcpy: {gb / bound:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
