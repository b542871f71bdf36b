#!/usr/bin/env python3
"""New weight versions into a real SGLang server, on real updates, side by side:
whole in float32, whole in bfloat16, and as a delta in bfloat16 (``engine.weight_sync``).

    .venv-sglang/bin/python tools/bench_sglang.py [--size smoke|1.2gb] [--lr 1e-4 1e-6] [--steps 4]
        [--json OUT]

For each learning rate the smoke recipe trains ``--steps`` steps (the embedded engine; a
checkpoint a step); with ``--size 1.2gb`` a Qwen3 shape of 0.30 B parameters (random float32
weights, the tiny tokenizer) takes that many AdamW steps on random tokens instead, because the
smoke model's 3.6 MB is all fixed cost. Each version then goes into the servers in turn, as a
cell pushes it: by reference, bucket by bucket (``TensorPush``). The first push of each path is
whole (nothing is held yet) and is not counted; the figures are the medians of the rest.
``changed`` is the share of elements whose bits differ in the served dtype from the version
before. The bound printed beside them is one in-memory copy of the same version whole in
bfloat16 (``memcpy``): the ratio is the version's whole bf16 bytes per second of a push over
that copy's rate. The last row is what a push costs whatever it carries: a delta of nothing
(three calls to the server).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_hpc.engines.sglang import SGLangServer, TensorPush, call  # noqa: E402
from gyre_hpc.models.architecture import ModelConfig  # noqa: E402
from gyre_hpc.models.causal_lm import CausalLM  # noqa: E402
from gyre_hpc.models.flat import FlatLayout  # noqa: E402
from gyre_hpc.models.tiny import init_tiny  # noqa: E402
from gyre_hpc.recipe.schema import EngineConfig  # noqa: E402
from gyre_hpc.trainer.checkpoint import read_weights  # noqa: E402

SIZE_1_2GB = dict(
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=128,
)
"""≈ 0.30 B parameters, 1.2 GB at float32."""

PATHS = (
    ("whole float32", "float32", False),
    ("whole bfloat16", "bfloat16", False),
    ("delta bfloat16", "bfloat16", True),
)


def checkpoints(runs: Path, lr: float, steps: int) -> list[Path]:
    """The smoke recipe trained ``steps`` steps at ``lr``: its checkpoints, oldest first."""
    sets = [f"run.runs_dir={runs}", f"run.steps={steps}", f"trainer.lr={lr}"]
    cmd = [sys.executable, "-m", "gyre_hpc", "run", str(REPO / "recipes" / "smoke.toml")]
    cmd += [arg for s in sets for arg in ("--set", s)]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    (run,) = runs.iterdir()
    return sorted((run / "checkpoints").glob("step-*"))


def adam_versions(root: Path, lr: float, steps: int) -> tuple[Path, list[np.ndarray]]:
    """A 0.30 B-parameter Qwen3 shape with random weights (written as a model directory) and the
    flat versions of ``steps`` AdamW steps on random tokens from it, the first being itself."""
    import torch

    model_dir = init_tiny(root / "model", seed=0)  # tokenizer, template, a config to widen
    config = replace(ModelConfig.load(model_dir), **SIZE_1_2GB)
    layout = FlatLayout.of(config)
    first = np.random.default_rng(0).standard_normal(layout.numel, dtype=np.float32) * np.float32(0.02)
    (model_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    layout.save(first, model_dir, model_dir)
    model = CausalLM(config)
    weights = torch.from_numpy(first.copy())
    layout.load(model, weights)
    layout.bind(model, weights, torch.zeros_like(weights))  # each step lands in ``weights``
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    tokens = torch.Generator().manual_seed(0)
    versions = [first]
    for _ in range(steps - 1):
        ids = torch.randint(0, config.vocab_size, (1, 65), generator=tokens)
        logits, _ = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay views of their buffer
        versions.append(weights.numpy().copy())
    return model_dir, versions


def pushes(server: SGLangServer, push: TensorPush, flats: list[np.ndarray]) -> list[tuple[float, object]]:
    """Every version in turn, as a cell loads it: (seconds, what it moved) each."""
    out = []
    for version, flat in enumerate(flats, 1):
        t0 = time.perf_counter()
        call(server.url, lambda c: c.begin_weight_update())
        pushed = push.push(flat, version)
        call(server.url, lambda c: c.end_weight_update())
        out.append((time.perf_counter() - t0, pushed))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("smoke", "1.2gb"), default="smoke")
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-4, 1e-6])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.size == "smoke":
            runs = {lr: checkpoints(root / f"runs-{lr:g}", lr, args.steps) for lr in args.lr}
            model_dir = runs[args.lr[0]][0]
            versions = {lr: [read_weights(p) for p in paths] for lr, paths in runs.items()}
        else:
            made = {lr: adam_versions(root / f"adam-{lr:g}", lr, args.steps) for lr in args.lr}
            model_dir = made[args.lr[0]][0]
            versions = {lr: flats for lr, (_, flats) in made.items()}
        layout = FlatLayout.of(ModelConfig.load(model_dir))
        servers = {}
        try:
            for dtype in ("float32", "bfloat16"):
                engine = EngineConfig(
                    backend="sglang", dtype=dtype, weight_sync="delta", max_total_tokens=4096
                )
                servers[dtype] = SGLangServer(engine, model_dir, root / f"sglang-{dtype}", device="cpu")
                servers[dtype].start()
            whole_bf16 = layout.numel * 2
            src, dst = np.ones(whole_bf16, np.uint8), np.empty(whole_bf16, np.uint8)
            copies = []
            for _ in range(20):
                t0 = time.perf_counter()
                np.copyto(dst, src)
                copies.append(time.perf_counter() - t0)
            memcpy = whole_bf16 / median(copies) / 1e9
            for lr, flats in versions.items():
                for name, dtype, delta in PATHS:
                    push = TensorPush(servers[dtype].url, layout, 1, "cpu", dtype, 512 << 20, delta)
                    measured = pushes(servers[dtype], push, flats)[1:]  # the first is whole anyway
                    seconds = median(s for s, _ in measured)
                    sent = median(p.sent for _, p in measured)
                    changed = [p.changed_fraction for _, p in measured if p.changed_fraction is not None]
                    figures[f"{name} @ lr {lr:g}"] = {
                        "bytes": int(sent),
                        "seconds": round(seconds, 4),
                        "gb_per_s": round(sent / seconds / 1e9, 3),
                        "of_memcpy": round(whole_bf16 / seconds / 1e9 / memcpy, 4),
                        "changed": round(median(changed), 4) if changed else None,
                    }
            # What any push costs here whatever it carries: the last version again, as a delta
            # of nothing (begin, one update, end: three calls to the server).
            floor = pushes(servers["bfloat16"], push, [flats[-1]] * 6)
            figures["delta of nothing (the fixed cost)"] = {
                "bytes": int(median(p.sent for _, p in floor)),
                "seconds": round(median(s for s, _ in floor), 4),
                "gb_per_s": 0.0,
                "of_memcpy": round(whole_bf16 / median(s for s, _ in floor) / 1e9 / memcpy, 4),
                "changed": 0.0,
            }
        finally:
            for server in servers.values():
                server.stop()
    print(f"{layout.numel:,} parameters; whole: {layout.numel * 4:,} B float32, {whole_bf16:,} B bfloat16;"
          f" memcpy of the bf16 version: {memcpy:.2f} GB/s")  # fmt: skip
    heads = ("bytes", 12), ("of bf16", 8), ("seconds", 9), ("GB/s", 7), ("of memcpy", 10), ("changed", 8)
    print(f"{'path':<36}" + "".join(f" {h:>{w}}" for h, w in heads))
    for name, f in figures.items():
        changed = "" if f["changed"] is None else f"{f['changed']:.1%}"
        print(f"{name:<36} {f['bytes']:>12,} {f['bytes'] / whole_bf16:>8.1%} {f['seconds']:>9.4f}"
              f" {f['gb_per_s']:>7.3f} {f['of_memcpy']:>10.2%} {changed:>8}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"memcpy_gb_per_s": round(memcpy, 2), "paths": figures}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
