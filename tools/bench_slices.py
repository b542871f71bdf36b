#!/usr/bin/env python3
"""The core's sum of a satellite's gradient: whole at the leader against slice by slice at every
rank, side by side in one run, with memcpy as the bound.

    python tools/bench_slices.py [--tp 2 --pp 2] [--repeat 3]

Re-launches itself under mpirun with the runtime's layout for two megatron cells of tp × pp
ranks: rank 0 owns the claim counter (the controller), the core's ranks come next, then the
satellite's. The model is ``tools/bench_shards.py``'s Qwen3 shape (~235M parameters); only its
config is written, the buffers are random. Two ways of summing one satellite's gradient into
the core's, through the transport ``transport.backend = auto`` picks:

- whole: the satellite's leader exposes the whole flat gradient, the core's leader pulls it and
  adds it into its own (what the runtime did before slices);
- sliced: every satellite rank exposes its slice (``runtime.main.transport_plan``), every core
  rank pulls its counterpart's at the same time and adds it into its own
  (``trainer.data_parallel.add_gradients``' pull and sum).

For each: the wall seconds (the slowest rank), the GB/s of the whole model's bytes, the bytes
and the peak of the largest buffer any one rank held, and a rank's own GB/s against a
one-process memcpy of its bytes (the bound on one host: every rank shares its memory).
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


def best_of(n: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def worker(model_dir: Path, tp: int, pp: int, repeat: int) -> None:
    from mpi4py import MPI

    from gyre_hpc.plan.ranks import RankLayout
    from gyre_hpc.recipe.schema import TrainerConfig, TransportConfig
    from gyre_hpc.runtime.main import transport_plan
    from gyre_hpc.runtime.protocol import wait_barrier
    from gyre_hpc.trainer.data_parallel import add_into
    from gyre_hpc.transport import TransportPlan, make_transport

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    layout = RankLayout(cells=2, ranks_per_cell=tp * pp)
    sliced = transport_plan(layout, model_dir, TrainerConfig(backend="megatron", tp_size=tp, pp_size=pp))
    core, satellite = layout.ranks_of(0), layout.ranks_of(1)
    whole = TransportPlan(sliced.params, core=core[0], counter=0, grads={satellite[0]: sliced.params})
    results = {}
    for name, plan in (("whole", whole), ("sliced", sliced)):
        t = make_transport(comm, plan, TransportConfig())
        if rank in plan.grads:
            t.gradient_buffer()[:] = 1.0
        source = None
        if rank in core:
            counterpart = satellite[core.index(rank)]
            source = counterpart if counterpart in plan.grads else None
        n = plan.grads[source] if source is not None else 0
        own, part = np.zeros(n, np.float32), np.empty(n, np.float32)
        wait_barrier(comm, 600)
        seconds, mine_s, memcpy = [], [], 0.0
        for _ in range(repeat):
            comm.Barrier()
            started = time.perf_counter()
            if source is not None:
                t.pull_gradient(source, part)
                add_into(own, part)
            took = time.perf_counter() - started
            mine_s.append(took)
            seconds.append(max(comm.allgather(took)))  # the slowest rank's
        if source is not None:
            assert float(own[0]) == repeat
            memcpy = best_of(3, lambda: np.copyto(part, own))  # noqa: B023
        mine = (rank, n, min(mine_s), memcpy)
        got = comm.gather(mine, root=0)
        if rank == 0:
            working = [g for g in got if g[1]]
            results[name] = {
                "wall_s": min(seconds),
                "largest_buffer_gb": max(4 * g[1] for g in working) / 1e9,
                "ranks": [{"rank": r, "values": v, "pull_sum_s": s, "memcpy_s": m} for r, v, s, m in working],
            }
        wait_barrier(comm, 600)
        t.close()
    if rank == 0:
        gb = 4 * sliced.params / 1e9
        print(f"Qwen3-shaped, {sliced.params / 1e6:.0f}M parameters ({gb:.2f} GB fp32); two cells of "
              f"tp {tp} × pp {pp}; {size} ranks; best of {repeat}")  # fmt: skip
        print(f"{'':>7} {'wall s':>7} {'GB/s (model)':>13} {'largest buffer GB':>18} "
              f"{'a rank: GB/s':>13} {'memcpy GB/s':>12}")  # fmt: skip
        for name, r in results.items():
            per = [4 * x["values"] / 1e9 / x["pull_sum_s"] for x in r["ranks"]]
            mem = [4 * x["values"] / 1e9 / x["memcpy_s"] for x in r["ranks"]]
            print(f"{name:>7} {r['wall_s']:>7.3f} {gb / r['wall_s']:>13.2f} {r['largest_buffer_gb']:>18.3f} "
                  f"{min(per):>6.2f}–{max(per):<6.2f} {min(mem):>5.2f}–{max(mem):<6.2f}")  # fmt: skip
        ratio = results["whole"]["wall_s"] / results["sliced"]["wall_s"]
        print(
            f"sliced / whole: {ratio:.2f}× faster, the largest buffer "
            f"{results['sliced']['largest_buffer_gb'] / results['whole']['largest_buffer_gb']:.2f}×"
        )
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
    from gyre_hpc.models.architecture import Qwen3Config
    from tools.bench_shards import SHAPE

    model_dir = Path(tempfile.mkdtemp(prefix="bench-slices-"))
    (model_dir / "config.json").write_text(json.dumps(Qwen3Config(**SHAPE).to_hf()))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "BENCH_SLICES_MODEL": str(model_dir), "PYTHONPATH": str(HERE)}  # fmt: skip
    if args.json:
        env["BENCH_SLICES_JSON"] = str(args.json.resolve())
    ranks = 1 + 2 * args.tp * args.pp
    cmd = ["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable, __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env, cwd=HERE).returncode)


if __name__ == "__main__":
    main()
