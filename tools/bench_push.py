#!/usr/bin/env python3
"""One weight push from a megatron cell into its engine's staging: the leader gathering the whole
flat weights and staging buckets from them (what a cell did before it streamed) against whole
tensors streamed from the ranks' slices (``MegatronTrainer.hf_tensors`` into
``engines.staging.Stager``), side by side in one run, with one memcpy of the model as the bound.

    python tools/bench_push.py [--tp 2 --pp 2] [--bucket-mb 512]

Re-launches itself under mpirun: one megatron cell of tp × pp ranks holding a Qwen3-shaped model
(``tools/bench_shards.py``'s ~235M parameters, random weights written once to a temporary
directory). Buckets are staged as the CPU path stages them, in shared memory, and dropped (the
server's own copy into its weights is not this side's cost). For each way: the wall seconds, the
largest staging buffer, and the leader's peak resident memory above what it held before either
(``VmHWM``; the streamed way runs first, so each peak is its own).
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

HERE = Path(__file__).resolve().parents[1]


def high_water() -> int:
    """This process's peak resident bytes so far."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(model_dir: Path, tp: int, pp: int, bucket_bytes: int) -> None:
    import torch
    from mpi4py import MPI

    from gyre_hpc.engines.staging import Stager, flat_tensors
    from gyre_hpc.recipe.schema import TrainerConfig
    from gyre_hpc.trainer.megatron_backend import MegatronTrainer, MegatronWorld
    from tools.bench_transport import best_of

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    port = comm.bcast(MegatronWorld.alone().port if rank == 0 else None, root=0)
    config = TrainerConfig(backend="megatron", tp_size=tp, pp_size=pp)
    trainer = MegatronTrainer(
        model_dir, config, core=False, world=MegatronWorld(rank, size, "127.0.0.1", port)
    )
    results = {}

    def stager() -> Stager:
        return Stager(torch.float32, bucket_bytes, lambda n: torch.empty(n).share_memory_())

    base = high_water()

    def push(name: str, tensors) -> None:  # type: ignore[no-untyped-def]
        comm.Barrier()
        started = time.perf_counter()
        s = stager()
        for _ in s.stage(tensors()) if rank == 0 else tensors():
            pass
        took = max(comm.allgather(time.perf_counter() - started))
        if rank == 0:
            results[name] = {"s": took, "staging_gb": s.peak_bytes / 1e9, "largest_gb": s.largest / 1e9,
                             "leader_peak_gb": (high_water() - base) / 1e9}  # fmt: skip

    push("streamed from the slices", trainer.hf_tensors)

    def whole():  # type: ignore[no-untyped-def]
        flat = trainer.weights()  # collective: every rank takes part, the leader holds it
        return flat_tensors(trainer.flat_layout, flat) if rank == 0 else iter(())

    push("gathered whole, then staged", whole)
    if rank == 0:
        nbytes = 4 * trainer.numel
        a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        memcpy = best_of(3, lambda: np.copyto(b, a))
        print(
            f"Qwen3-shaped, {trainer.numel / 1e6:.0f}M parameters ({nbytes / 1e9:.2f} GB fp32); one cell of "
            f"tp {tp} × pp {pp}; buckets of {bucket_bytes / 1e6:.0f} MB; memcpy of the model {memcpy:.3f} s"
        )
        print(f"{'':>30} {'s':>7} {'vs memcpy':>10} {'staging GB':>11} {'largest tensor GB':>18} "
              f"{'leader peak +GB':>16}")  # fmt: skip
        for name, r in results.items():
            print(f"{name:>30} {r['s']:>7.3f} {r['s'] / memcpy:>9.1f}x {r['staging_gb']:>11.3f} "
                  f"{r['largest_gb']:>18.3f} {r['leader_peak_gb']:>16.3f}")  # fmt: skip
        out = os.environ.get("BENCH_PUSH_JSON")
        if out:
            Path(out).write_text(json.dumps({"memcpy_s": memcpy, **results}, indent=1) + "\n")
    comm.Barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        worker(Path(os.environ["BENCH_PUSH_MODEL"]), args.tp, args.pp, args.bucket_mb << 20)
        return
    sys.path.insert(0, str(HERE))
    from gyre_hpc.models.architecture import ModelConfig
    from gyre_hpc.models.flat import FlatLayout
    from tools.bench_shards import SHAPE

    model_dir = Path(tempfile.mkdtemp(prefix="bench-push-"))
    config = ModelConfig(**SHAPE)
    (model_dir / "config.json").write_text(json.dumps(config.to_hf()))
    layout = FlatLayout.of(config)
    flat = np.random.default_rng(0).standard_normal(layout.numel, dtype=np.float32) * 0.02
    layout.save_weights(flat, model_dir)
    del flat
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "BENCH_PUSH_MODEL": str(model_dir), "PYTHONPATH": str(HERE)}  # fmt: skip
    if args.json:
        env["BENCH_PUSH_JSON"] = str(args.json.resolve())
    cmd = ["mpirun", "--oversubscribe", "-n", str(args.tp * args.pp), sys.executable, __file__, *sys.argv[1:]]
    try:
        sys.exit(subprocess.run(cmd, env=env, cwd=HERE).returncode)
    finally:
        for f in model_dir.iterdir():
            f.unlink()
        model_dir.rmdir()


if __name__ == "__main__":
    main()
