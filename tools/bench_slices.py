#!/usr/bin/env python3
"""Moving a satellite's gradient to the core and the core's weights to a satellite: whole at the
leaders against slice by slice at every rank, side by side in one run, with memcpy as the bound.

    python tools/bench_slices.py [--tp 2 --pp 2] [--repeat 3]

Re-launches itself under mpirun with the runtime's layout for two megatron cells of tp × pp
ranks: rank 0 owns the claim counter (the controller), the core's ranks come next, then the
satellite's. The model is ``tools/bench_shards.py``'s Qwen3 shape (~235M parameters); only its
config is written, the buffers are random. Through the transport ``transport.backend = auto``
picks, each move two ways:

- whole (what the runtime did before slices): the satellite's leader exposes the whole flat
  gradient and the core's leader pulls it and adds it into its own; the satellite's leader
  pulls the core's whole fp32 snapshot;
- sliced: every satellite rank exposes its gradient slice (``runtime.main.transport_plan``) and
  every core rank pulls its counterpart's at the same time and adds it into its own
  (``trainer.data_parallel.add_gradients``); every satellite rank pulls its counterpart's weight
  slice (``pull_slice``), in fp32 and in bf16 (half the bytes).

For each: the wall seconds (the slowest rank), the bytes moved in all, the largest buffer one
rank moved, and each moving rank's GB/s against a one-process memcpy of as many bytes, measured
by that rank right after (on one host every rank shares the same memory: the sum over ranks is
bounded by one memcpy's bandwidth, not by their count).
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


def worker(model_dir: Path, tp: int, pp: int, repeat: int) -> None:
    from mpi4py import MPI

    from gyre_hpc.models.architecture import ModelConfig
    from gyre_hpc.models.flat import FlatLayout
    from gyre_hpc.plan.ranks import RankLayout
    from gyre_hpc.recipe.schema import TrainerConfig, TransportConfig
    from gyre_hpc.runtime.main import transport_plan
    from gyre_hpc.runtime.protocol import wait_barrier
    from gyre_hpc.trainer.data_parallel import add_into
    from gyre_hpc.transport import TransportPlan, make_transport
    from tools.bench_transport import best_of

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    layout = RankLayout(cells=2, ranks_per_cell=tp * pp)
    sliced = transport_plan(layout, model_dir, TrainerConfig(backend="megatron", tp_size=tp, pp_size=pp))
    core, satellite = layout.ranks_of(0), layout.ranks_of(1)
    numel = FlatLayout.of(ModelConfig.load(model_dir)).numel  # a whole snapshot (sliced: none)
    whole = TransportPlan(numel, core=core[0], counter=0, grads={satellite[0]: numel})
    results = {}

    def measure(name: str, nbytes: int, move) -> None:  # type: ignore[no-untyped-def]
        """``move()`` on the ranks that move ``nbytes`` (0: idle), all at once, ``repeat`` times;
        then each working rank's memcpy of as many bytes."""
        wait_barrier(comm, 600)
        wall, mine = [], []
        for _ in range(repeat):
            comm.Barrier()
            started = time.perf_counter()
            if nbytes:
                move()
            took = time.perf_counter() - started
            mine.append(took)
            wall.append(max(comm.allgather(took)))  # the slowest rank's
        memcpy = 0.0
        if nbytes:
            a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
            memcpy = best_of(3, lambda: np.copyto(b, a))
        got = comm.gather((rank, nbytes, min(mine), memcpy), root=0)
        if rank == 0:
            working = [g for g in got if g[1]]
            results[name] = {
                "wall_s": min(wall),
                "bytes": sum(g[1] for g in working),
                "largest_buffer_gb": max(g[1] for g in working) / 1e9,
                "ranks": [{"rank": r, "bytes": n, "s": s, "memcpy_s": m} for r, n, s, m in working],
            }

    for kind, plan in (("whole", whole), ("sliced", sliced)):
        t = make_transport(comm, plan, TransportConfig())
        # The core sums a satellite's gradient: its leader the whole, or each rank its slice.
        if rank in plan.grads:
            t.gradient_buffer()[:] = 1.0
        pair = satellite[core.index(rank)] if rank in core else None
        n = plan.grads.get(pair, 0) if pair is not None else 0
        own, part = np.zeros(n, np.float32), np.empty(n, np.float32)

        def pull_and_sum() -> None:
            t.pull_gradient(pair, part)  # noqa: B023
            add_into(own, part)  # noqa: B023

        measure(f"gradient pull + sum, {kind}", 4 * n, pull_and_sum)
        # A satellite's trainer takes the core's weights: the whole fp32 snapshot at its leader,
        # or each rank its slice, in fp32 and in bf16 (half the bytes: the norms stay fp32).
        if kind == "whole":
            if rank == core[0]:
                t.publish(np.ones(plan.params, np.float32), 1)
            dest = np.empty(plan.params if rank == satellite[0] else 0, np.float32)
            measure("weights pull, whole fp32", dest.nbytes, lambda: t.pull_snapshot(dest))  # noqa: B023
        else:
            source = core[satellite.index(rank)] if rank in satellite else None
            for dtype, size_of in (("fp32", 1), ("bf16", 2)):
                if rank in plan.slices:
                    t.publish_slice(np.ones(plan.slices[rank] // size_of, np.uint8), 1)
                into = np.empty(plan.slices[source] if source is not None else 0, np.uint8)
                held = plan.slices[source] // size_of if source is not None else 0
                measure(f"weights pull, sliced {dtype}", held, lambda: t.pull_slice(source, into))  # noqa: B023
        wait_barrier(comm, 600)
        t.close()
    if rank == 0:
        gb = 4 * numel / 1e9
        print(f"Qwen3-shaped, {numel / 1e6:.0f}M parameters ({gb:.2f} GB fp32); two cells of "
              f"tp {tp} × pp {pp}; {size} ranks; best of {repeat}")  # fmt: skip
        print(f"{'':>30} {'wall s':>7} {'GB moved':>9} {'largest GB':>11} {'a rank: GB/s':>15} "
              f"{'memcpy GB/s':>13} {'vs memcpy':>10}")  # fmt: skip
        for name, r in results.items():
            per = [x["bytes"] / 1e9 / x["s"] for x in r["ranks"]]
            mem = [x["bytes"] / 1e9 / x["memcpy_s"] for x in r["ranks"]]
            ratio = [p / m for p, m in zip(per, mem, strict=True)]
            print(f"{name:>30} {r['wall_s']:>7.3f} {r['bytes'] / 1e9:>9.3f} {r['largest_buffer_gb']:>11.3f} "
                  f"{min(per):>7.2f}–{max(per):<7.2f} {min(mem):>6.2f}–{max(mem):<6.2f} "
                  f"{min(ratio):>4.0%}–{max(ratio):<4.0%}")  # fmt: skip
        out = os.environ.get("BENCH_SLICES_JSON")
        if out:
            Path(out).write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        worker(Path(os.environ["BENCH_SLICES_MODEL"]), args.tp, args.pp, args.repeat)
        return
    sys.path.insert(0, str(HERE))
    from gyre_hpc.models.architecture import ModelConfig
    from tools.bench_shards import SHAPE

    model_dir = Path(tempfile.mkdtemp(prefix="bench-slices-"))
    (model_dir / "config.json").write_text(json.dumps(ModelConfig(**SHAPE).to_hf()))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "BENCH_SLICES_MODEL": str(model_dir), "PYTHONPATH": str(HERE)}  # fmt: skip
    if args.json:
        env["BENCH_SLICES_JSON"] = str(args.json.resolve())
    ranks = 1 + 2 * args.tp * args.pp
    cmd = ["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable, __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env, cwd=HERE).returncode)


if __name__ == "__main__":
    main()
