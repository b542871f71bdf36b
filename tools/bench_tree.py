#!/usr/bin/env python3
"""Tree-packed training against path-by-path training, side by side on the same selected paths.

Three workloads, each selected with Jmax ∈ {1, 5, ∞} (``trajectory.select_paths``, role priority):

  long       trees recorded by real executions of ``repo-mini-long`` (the tiny warm model through
             the proxy and the built-in harness, compacting past ``--context`` tokens: each
             compaction restarts from the prompt and a summary); recorded here with
             ``gyre-hpc eval`` unless ``--tito`` names a run's ``tito.bin``
  deep       synthetic runs with a deep shared prefix: a ``--prefix``-token context forked into
             compactions and sub-agent branches that all keep it
  synthetic  the ~1M-token run of ``bench_trajectory.py`` (tokens only: too big to forward here)

For each: tokens forwarded — paths one by one; one tree per run (what megatron forwards under
a dense mask; the bound is each run's selected paths' unique tokens, reached unless the
micro-step budget cuts a run); one forest per micro-step (runs share their prompt too: the
torch backend, and megatron under FlexAttention) — and the forward-backward FLOPs of the run
trees against the paths at Qwen3-8B's shape under exact sparse attention. Then, on the torch
backend, the time of the whole step's micro-steps and the peak memory over them, each side in a
fresh process (tree: ``trajectory.packing = "tree"``; paths: the same sequences one by one,
packed by path length). The paper's cost of Jmax = 5 and 1
relative to uncapped (74.8 % and 41.4 %) is set against ours in the last table.

    python tools/bench_tree.py [--tito RUN/tito.bin] [--n 12] [--budget 8192] [--prefix 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from gyre_hpc.models.architecture import ModelConfig  # noqa: E402
from gyre_hpc.step.batch import pack  # noqa: E402
from gyre_hpc.trajectory import TitoRecord, TrajectoryTree, select_paths  # noqa: E402
from gyre_hpc.trajectory.codec import by_run as encoded_by_run  # noqa: E402
from gyre_hpc.trajectory.codec import read_records  # noqa: E402
from gyre_hpc.trajectory.packing import (  # noqa: E402
    by_run,
    forwarded_tokens,
    pack_tree,
    pack_tree_micro_steps,
    unique_tokens,
)
from gyre_hpc.trajectory.sequences import TrainSequence, build_batch  # noqa: E402

JMAX = {"1": 1, "5": 5, "∞": 10**9}
PAPER = {"5": 0.748, "1": 0.414}
QWEN3_8B = ModelConfig(
    vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    max_position_embeddings=40_960,
)  # fmt: skip
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


# ---- workloads ----------------------------------------------------------------------------------


def record_long(n: int, context: int, out: Path) -> Path:
    """Run ``n`` repo-mini-long tasks with the tiny warm model; the run's TITO log."""
    cmd = [
        sys.executable, "-m", "gyre_hpc", "eval", str(REPO / "recipes" / "smoke.toml"),
        "--suite", "repo-mini-long", "--split", "train", "--n", str(n),
        "--set", f"run.runs_dir={out}", "--set", f"agent.context_limit_tokens={context}",
        "--set", "agent.max_calls=24", "--set", "engine.max_new_tokens=96",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ROOT_OK})
    if proc.returncode:
        sys.exit(f"recording the long suite failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return next(out.glob("*/tito.bin"))


def read_trees(tito: Path) -> list[TrajectoryTree]:
    runs = sorted(encoded_by_run(read_records(tito).records))
    return [TrajectoryTree.from_encoded(encoded) for _, encoded in runs]


class DeepRun:
    """One run whose main context (``prefix`` tokens) forks into three compaction summaries, two
    sub-agents and a last main call: six leaves over one long shared prefix."""

    def __init__(self, run_id: str, prefix: int, vocab: int, rng: np.random.Generator) -> None:
        self.run_id, self.vocab, self.rng = run_id, vocab, rng
        self.records: list[TitoRecord] = []
        context = self.tokens(prefix)
        for k in range(3):  # the context as it grows, summarised at three points
            context += self.call("main", context, 120) + self.tokens(200)
            self.call("main-summary", context + self.tokens(20), 150 + 10 * k)
        for _ in range(2):  # sub-agents that see the whole main context (shared, not their own)
            sub = context + self.tokens(60)
            sub += self.call("sub-agent", sub, 100) + self.tokens(80)
            self.call("sub-agent-summary", sub, 80)
        self.call("main", context, 120)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()

    def call(self, role: str, inp: list[int], n_out: int) -> list[int]:
        out = self.tokens(n_out)
        lp = (-self.rng.random(n_out)).tolist()
        self.records.append(TitoRecord(self.run_id, f"c{len(self.records)}", role, inp, out, lp))
        return out


def deep_trees(runs: int, prefix: int, vocab: int, seed: int) -> list[TrajectoryTree]:
    rng = np.random.default_rng(seed)
    return [TrajectoryTree.from_records(DeepRun(f"deep{r}", prefix, vocab, rng).records) for r in range(runs)]


def synthetic_trees(seed: int) -> list[TrajectoryTree]:
    from bench_trajectory import SyntheticRun

    return [TrajectoryTree.from_records(SyntheticRun(seed, 800))]


def sequences(trees: list[TrajectoryTree], jmax: int, seed: int) -> list[TrainSequence]:
    paths = {t.run_id: select_paths(t, jmax, random.Random(seed)) for t in trees}
    return build_batch(paths, dict.fromkeys(paths, 1.0)).sequences


def workload(name: str, args: argparse.Namespace, vocab: int) -> list[TrajectoryTree]:
    if name == "long":
        return read_trees(Path(args.tito))
    if name == "deep":
        return deep_trees(args.runs, args.prefix, vocab, args.seed)
    return synthetic_trees(args.seed)


# ---- one side, in its own process -----------------------------------------------------------------


def measure(args: argparse.Namespace) -> None:
    """Child: forward-backward every micro-step of one side; time and peak memory as JSON."""
    import torch

    from gyre_hpc.builtin_models.resolve import resolve_model
    from gyre_hpc.models.architecture import ModelConfig
    from gyre_hpc.recipe.schema import TrainerConfig
    from gyre_hpc.trainer.torch_backend import TorchTrainer

    torch.set_num_threads(args.threads)
    model = resolve_model("tiny-warm")
    vocab = ModelConfig.load(model).vocab_size
    seqs = sequences(workload(args.workload, args, vocab), JMAX[args.jmax], args.seed)
    queue = pack(seqs, args.budget, args.side)
    trainer = TorchTrainer(model, TrainerConfig(grad_clip=0.0), core=True, packing=args.side)
    trainer.micro_step(queue[-1][:1])  # warm the kernels on the smallest piece
    trainer.zero_grad()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    forwarded = sum(trainer.micro_step(mb).tokens for mb in queue)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grad = float(np.linalg.norm(trainer.gradient()))
    print(json.dumps({"seconds": seconds, "forwarded": forwarded, "micro_steps": len(queue),
                      "peak_mib": (peak - base) / 1024, "grad_norm": grad}))  # fmt: skip


def run_side(args: argparse.Namespace, name: str, jmax: str, side: str) -> dict:
    cmd = [
        sys.executable, __file__, "--child", "--workload", name, "--jmax", jmax, "--side", side,
        "--budget", str(args.budget), "--prefix", str(args.prefix), "--runs", str(args.runs),
        "--seed", str(args.seed), "--threads", str(args.threads), "--tito", str(args.tito or ""),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} Jmax={jmax} {side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the report -----------------------------------------------------------------------------------


def flops(units: list[np.ndarray], c: ModelConfig) -> float:
    """Forward + backward FLOPs of forwarding each array of positions as one unit under an exact
    sparse attention: 6 per parameter per token, and per attended (query, key) pair 6 · heads ·
    head_dim per layer for QKᵀ and AV (a token at position p attends to p + 1 keys)."""
    params = (
        c.num_hidden_layers
        * (
            c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
            + 3 * c.hidden_size * c.intermediate_size
        )
        + c.hidden_size * c.vocab_size
    )
    pairs = sum(float((u + 1).sum()) for u in units)
    tokens = sum(len(u) for u in units)
    return 6 * params * tokens + 6 * 2 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tito", default="", help="A recorded run's tito.bin (default: record one).")
    ap.add_argument("--n", type=int, default=12, help="repo-mini-long tasks to record.")
    ap.add_argument("--context", type=int, default=3000, help="Compaction threshold while recording.")
    ap.add_argument("--budget", type=int, default=8192, help="Tokens per micro-step (forwarded).")
    ap.add_argument("--prefix", type=int, default=3000, help="deep: shared prefix tokens.")
    ap.add_argument("--runs", type=int, default=4, help="deep: runs.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--jmax", help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return measure(args)

    from gyre_hpc.builtin_models.resolve import resolve_model
    from gyre_hpc.models.architecture import ModelConfig

    console = Console(width=140)
    vocab = ModelConfig.load(resolve_model("tiny-warm")).vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        if not args.tito:
            with console.status(f"recording {args.n} repo-mini-long executions (gyre-hpc eval)…"):
                args.tito = str(record_long(args.n, args.context, Path(tmp)))
        trees = {name: workload(name, args, vocab) for name in ("long", "deep", "synthetic")}
        report(args, trees, console)  # the timed sides read the recorded log too


def report(args: argparse.Namespace, trees: dict[str, list[TrajectoryTree]], console: Console) -> None:
    tokens = Table(
        title="tokens forwarded per step: paths one by one, one tree per run, one tree per micro-step"
    )
    for col in ("workload", "runs · leaves · roles", "budget", "Jmax", "paths", "paths tokens", "run trees",
                "run trees / paths", "/ bound", "forest / paths", "FLOPs run trees / paths, 8B"):  # fmt: skip
        tokens.add_column(col, justify="left" if len(tokens.columns) < 2 else "right")
    timing = Table(title="torch backend, tiny model, CPU: a step's micro-steps, one process per side")
    for col in ("workload", "Jmax", "micro-steps paths / tree", "seconds paths", "seconds tree",
                "time tree / paths", "peak MiB paths", "peak MiB tree", "‖g‖ paths / tree"):  # fmt: skip
        timing.add_column(col, justify="left" if col == "workload" else "right")
    costs: dict[tuple[str, str], dict[str, float]] = {}
    for name, ts in trees.items():
        roles = sorted({leaf.role for t in ts for leaf in t.leaves()})
        shape = f"{len(ts)} · {sum(len(t.leaves()) for t in ts)} · {', '.join(roles)}"
        # A path is never split, so a run of ~1M tokens trains under a budget that holds it.
        budget = (
            max(args.budget, max(t.num_unique_tokens for t in ts)) if name == "synthetic" else args.budget
        )
        for jmax in JMAX:
            seqs = sequences(ts, JMAX[jmax], args.seed)
            queue = pack_tree_micro_steps(seqs, budget)
            paths_tokens = sum(len(s) for s in seqs)
            tree_tokens = sum(forwarded_tokens(mb) for mb in queue)
            forest_tokens = sum(unique_tokens(mb) for mb in queue)
            bound = sum(unique_tokens(run) for run in by_run(seqs))  # each run's selected paths, once
            tree_units = [pack_tree(run).positions for mb in queue for run in by_run(mb)]
            ratio_flops = flops(tree_units, QWEN3_8B) / flops([np.arange(len(s)) for s in seqs], QWEN3_8B)
            costs[name, jmax] = {"paths": paths_tokens, "tree": tree_tokens}
            tokens.add_row(
                name, shape, f"{budget:,}", jmax, str(len(seqs)), f"{paths_tokens:,}", f"{tree_tokens:,}",
                f"{tree_tokens / max(paths_tokens, 1):.3f}", f"{tree_tokens / max(bound, 1):.3f}",
                f"{forest_tokens / max(paths_tokens, 1):.3f}", f"{ratio_flops:.3f}",
            )  # fmt: skip
            shape = ""
            if name == "synthetic":
                continue
            with console.status(f"{name} Jmax={jmax}: timing both sides…"):
                p, t = run_side(args, name, jmax, "paths"), run_side(args, name, jmax, "tree")
            costs[name, jmax] |= {"paths_s": p["seconds"], "tree_s": t["seconds"]}
            timing.add_row(
                name, jmax, f"{p['micro_steps']} / {t['micro_steps']}", f"{p['seconds']:.2f}",
                f"{t['seconds']:.2f}", f"{t['seconds'] / p['seconds']:.3f}", f"{p['peak_mib']:.0f}",
                f"{t['peak_mib']:.0f}", f"{p['grad_norm']:.5g} / {t['grad_norm']:.5g}",
            )  # fmt: skip
    console.print(tokens)
    console.print(timing)
    jm = Table(title="cost of Jmax relative to uncapped path-by-path training (paper: forward-backward)")
    for col in ("workload", "Jmax", "paper", "paths tokens", "tree tokens", "paths time", "tree time"):
        jm.add_column(col, justify="left" if col == "workload" else "right")
    for name in trees:
        ref = costs[name, "∞"]
        for jmax in ("5", "1"):
            c = costs[name, jmax]
            times = ["", ""]
            if "paths_s" in c:
                times = [f"{c['paths_s'] / ref['paths_s']:.1%}", f"{c['tree_s'] / ref['paths_s']:.1%}"]
            jm.add_row(
                name, jmax, f"{PAPER[jmax]:.1%}", f"{c['paths'] / ref['paths']:.1%}",
                f"{c['tree'] / ref['paths']:.1%}", *times,
            )  # fmt: skip
    console.print(jm)


if __name__ == "__main__":
    main()
