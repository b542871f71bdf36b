#!/usr/bin/env python3
"""What each rank of a megatron cell holds, before and after shards, side by side in one run.

    python tools/bench_shards.py --before CHECKOUT [--tp 2 --pp 2] [--json OUT]

A Qwen3-shaped random model (~235M parameters: 16 layers, hidden 1024, ffn 3072, vocab 32,000)
is trained for one step by a replica of tp × pp ranks (mpirun, gloo), as a core cell's ranks
do in the runtime: build and load, one micro-step, the gradient made ready for the transport, one
apply, the weights gathered for publishing, then its checkpoint (weights and optimizer state).
It runs twice: with the code of ``--before`` (a checkout, e.g. the commit before the shards) and
with this one. For each rank: peak resident memory after the step and after the checkpoint, the
whole-model host buffers it allocated, and its parameters; the step's and the checkpoint's
seconds. The honest bound is a rank's slice: its parameters, Adam's two moments and its
gradient. Then this code's checkpoint is exported as a Hugging Face model (``checkpoint.export_hf``,
in 256 MiB files): its seconds and peak memory, against a bucket and the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SHAPE = {
    "vocab_size": 32_000, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}  # fmt: skip


def worker(model_dir: Path, out: Path, tp: int, pp: int) -> None:
    """One rank: the step, then its figures gathered to rank 0, which writes ``out``."""
    import numpy as np
    from mpi4py import MPI

    from gyre_hpc.recipe.schema import TrainerConfig
    from gyre_hpc.trainer.megatron_backend import MegatronTrainer, MegatronWorld
    from gyre_hpc.trajectory.sequences import TrainSequence

    comm = MPI.COMM_WORLD
    sys.excepthook = lambda *exc: (traceback.print_exception(*exc), comm.Abort(1))  # none waits forever
    rank, size = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(MegatronWorld.alone().port if rank == 0 else None, root=0)
    started = time.perf_counter()
    cfg = TrainerConfig(lr=1e-5, grad_clip=0.0, tp_size=tp, pp_size=pp)
    trainer = MegatronTrainer(model_dir, cfg, core=True, world=MegatronWorld(rank, size, "127.0.0.1", port))
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], 256).astype(np.int32)
    mask = (np.arange(256) >= 64).astype(np.float32)
    seq = TrainSequence("bench", tokens, mask, np.where(mask > 0, -2.0, 0.0).astype(np.float32), 1.0,
                        1.0 / mask.sum())  # fmt: skip
    trainer.micro_step([seq])
    trainer.gradient()
    trainer.apply(1)
    trainer.weights()
    seconds = time.perf_counter() - started
    # Whole-model host buffers: the weights on the leader; the gradient too before it was sliced.
    whole = sum(b.nbytes for b in (trainer.flat, trainer.grad) if b.size >= trainer.numel)
    params = sum(p.numel() for p in trainer.params.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ckpt = out.with_suffix(".ckpt")
    ckpt.mkdir(exist_ok=True)  # as checkpoint.save makes it, before any rank writes
    started = time.perf_counter()
    if hasattr(trainer, "save_weights"):  # each rank its shard
        trainer.save_weights(ckpt, rank)
    else:  # the code before shards: the leader writes the whole weights it gathered
        from gyre_hpc.models.flat import FlatLayout

        flat = trainer.weights()
        if rank == 0:
            FlatLayout.of(trainer.model_config).save(flat, model_dir, ckpt)
    trainer.save_optimizer(ckpt, rank)
    comm.Barrier()
    ckpt_s = time.perf_counter() - started
    ckpt_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {"rank": rank, "peak_rss_gb": round(peak / 1e9, 3), "whole_buffers_gb": round(whole / 1e9, 3),
            "params": params, "seconds": round(seconds, 1), "checkpoint_s": round(ckpt_s, 1),
            "ckpt_peak_rss_gb": round(ckpt_peak / 1e9, 3)}  # fmt: skip
    got = comm.gather(mine, root=0)
    if rank == 0:
        out.write_text(json.dumps({"numel": trainer.numel, "ranks": got, "checkpoint": str(ckpt)}))


def export(ckpt: Path, model_dir: Path, out: Path, bucket: int) -> None:
    """This code's checkpoint as a Hugging Face model: seconds and peak memory into ``out``."""
    from gyre_hpc.models.hf_files import copy_model_files
    from gyre_hpc.trainer.checkpoint import export_hf

    copy_model_files(model_dir, ckpt)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    files = export_hf(ckpt, ckpt.with_suffix(".hf"), bucket)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"seconds": round(seconds, 2), "peak_rss_gb": round(peak / 1e9, 3),
                               "before_gb": round(base / 1e9, 3), "files": len(files)}))  # fmt: skip


def run(checkout: Path, model_dir: Path, tp: int, pp: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONWARNINGS": "ignore"}  # fmt: skip
    cmd = ["mpirun", "--oversubscribe", "-n", str(tp * pp), sys.executable, __file__, "--worker",
           str(model_dir), str(out), str(tp), str(pp)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{checkout}: the step failed: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--export":
        export(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the code to compare with")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from gyre_hpc.models.architecture import ModelConfig
    from tools.bench_megatron import write_model

    model_dir = write_model(ModelConfig(**SHAPE), Path(tempfile.mkdtemp(prefix="bench-shards-")) / "model")
    figures = {"before": run(args.before.resolve(), model_dir, args.tp, args.pp),
               "after": run(HERE, model_dir, args.tp, args.pp)}  # fmt: skip
    numel = figures["after"]["numel"]
    fp32 = 4 * numel / 1e9
    print(f"Qwen3-shaped, {numel / 1e6:.0f}M parameters ({fp32:.2f} GB in fp32), tp {args.tp} × pp {args.pp}")
    print(f"{'rank':>4} {'peak RSS GB before':>19} {'after':>7} {'ratio':>6} {'whole buffers GB':>17} "
          f"{'after':>6} {'params':>10} {'bound GB':>9}")  # fmt: skip
    for b, a in zip(figures["before"]["ranks"], figures["after"]["ranks"], strict=True):
        bound = a["params"] * (4 + 8 + 4) / 1e9  # weights, Adam's moments, the gradient: fp32
        print(f"{a['rank']:>4} {b['peak_rss_gb']:>19.2f} {a['peak_rss_gb']:>7.2f} "
              f"{a['peak_rss_gb'] / b['peak_rss_gb']:>6.2f} {b['whole_buffers_gb']:>17.2f} "
              f"{a['whole_buffers_gb']:>6.2f} {a['params']:>10,} {bound:>9.2f}")  # fmt: skip
    seconds = [max(r["seconds"] for r in figures[k]["ranks"]) for k in ("before", "after")]
    print(f"the step (build, load, micro-step, gradient, apply, weights): {seconds[0]} s before, "
          f"{seconds[1]} s after")  # fmt: skip
    print(f"{'rank':>4} {'checkpoint s before':>20} {'after':>6} {'peak RSS GB before':>19} {'after':>6}")
    for b, a in zip(figures["before"]["ranks"], figures["after"]["ranks"], strict=True):
        print(f"{a['rank']:>4} {b['checkpoint_s']:>20} {a['checkpoint_s']:>6} "
              f"{b['ckpt_peak_rss_gb']:>19.2f} {a['ckpt_peak_rss_gb']:>6.2f}")  # fmt: skip
    bucket, measured = 256 << 20, Path(tempfile.mkstemp(suffix=".json")[1])
    ckpt = figures["after"]["checkpoint"]
    cmd = [sys.executable, __file__, "--export", ckpt, str(model_dir), str(measured), str(bucket)]
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the export failed: {done.stderr[-2000:]}")
    figures["export"] = ex = json.loads(measured.read_text())
    largest = 2 * 4 * SHAPE["vocab_size"] * SHAPE["hidden_size"] / 1e9  # its shards, and them joined
    print(f"export to Hugging Face ({ex['files']} files of ≤ {bucket >> 20} MiB): {ex['seconds']} s, "
          f"peak RSS {ex['peak_rss_gb']:.2f} GB ({ex['before_gb']:.2f} before it began; a bucket and the "
          f"largest tensor twice: {bucket / 1e9 + largest:.2f} GB; the model: {fp32:.2f} GB)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
