#!/usr/bin/env python3
"""The transport on this machine: snapshot and gradient pulls against memcpy, and claim latency.

    python tools/bench_transport.py [--sizes 64,256,1024] [--claims 20000]

Re-launches itself under mpirun with the runtime's layout: rank 0 owns the micro-step counter
(the controller), rank 1 is the core (publishes the snapshot), rank 2 a satellite that pulls the
snapshot, exposes a gradient for the core to pull, and claims micro-steps. For each size the
table shows, measured side by side in one run, a plain one-process memcpy (numpy copyto) and
the one-sided pulls through the backend ``transport.backend = auto`` picks (goal: ≥ 50 % of
memcpy on one host).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np


def best_of(n: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def idle_recv(comm, source: int):  # type: ignore[no-untyped-def]
    """Receive without spinning: a blocking MPI receive busy-waits and steals a core."""
    while not comm.iprobe(source=source):
        time.sleep(0.001)
    return comm.recv(source=source)


def worker(sizes_mib: list[int], claims: int) -> None:
    from mpi4py import MPI
    from rich.console import Console
    from rich.table import Table

    from gyre_hpc.recipe.schema import TransportConfig
    from gyre_hpc.runtime.protocol import wait_barrier
    from gyre_hpc.trainer.data_parallel import add_into
    from gyre_hpc.transport import TransportPlan, make_transport

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rows = []
    for mib in sizes_mib:
        n = mib << 18  # float32 values in mib MiB
        plan = TransportPlan(n, core=1, counter=0, grads={2: n})
        t = make_transport(comm, plan, TransportConfig())
        if rank == 1:
            weights = np.random.default_rng(0).random(n, dtype=np.float32)
            t.publish(weights, 1)
        if rank == 2:
            t.gradient_buffer()[:] = 1.0
        wait_barrier(comm, 600)
        if rank == 2:
            src = np.random.default_rng(1).random(n, dtype=np.float32)
            dst = np.empty(n, np.float32)
            memcpy = best_of(3, lambda: np.copyto(dst, src))  # noqa: B023
            snap = best_of(3, lambda: t.pull_snapshot(dst))  # noqa: B023
            comm.send((memcpy, snap), dest=1)
        if rank == 1:
            memcpy, snap = idle_recv(comm, 2)
            dst = np.empty(n, np.float32)
            grad = best_of(3, lambda: t.pull_gradient(2, dst))  # noqa: B023
            assert float(dst[0]) == 1.0
            # The core's sum of a pulled gradient into its own: numpy's one thread, then torch's.
            total = np.zeros(n, np.float32)
            one = best_of(3, lambda: np.add(total, dst, out=total))  # noqa: B023
            threaded = best_of(3, lambda: add_into(total, dst))  # noqa: B023
            comm.send((memcpy, snap, grad, one, threaded), dest=0)
        if rank == 0:
            memcpy, snap, grad, one, threaded = idle_recv(comm, 1)
            gb = (n * 4) / 1e9
            rows.append((mib, gb / memcpy, gb / snap, gb / grad, gb / one, gb / threaded, t.name))
        wait_barrier(comm, 600)
        t.close()
    # Claim latency: the satellite takes micro-steps one by one, as a training cell does — once
    # while the counter's owner is outside MPI (busy elsewhere), once while it polls MPI.
    plan = TransportPlan(1, core=1, counter=0, grads={2: 1})
    t = make_transport(comm, plan, TransportConfig())
    lat: dict[str, np.ndarray] = {}
    for phase in ("owner outside MPI", "owner polling MPI"):
        wait_barrier(comm, 600)
        if rank == 0 and phase == "owner outside MPI":
            time.sleep(3.0)  # longer than the claims take
        if rank == 2:
            samples = np.empty(claims)
            for i in range(claims):
                s = time.perf_counter()
                t.claim()
                samples[i] = time.perf_counter() - s
            comm.send(samples, dest=0)
        if rank == 0:
            lat[phase] = idle_recv(comm, 2) * 1e6
    wait_barrier(comm, 600)
    if rank == 0:
        table = Table(title="transport on this machine (best of 3; GB/s = 1e9 bytes/s)")
        for col in (
            "size",
            "memcpy GB/s",
            "snapshot pull GB/s",
            "vs memcpy",
            "gradient pull GB/s",
            "sum GB/s: numpy",
            "threaded",
            "backend",
        ):
            table.add_column(col, justify="right")
        for mib, mem, snap, grad, one, threaded, name in rows:
            size = f"{mib} MiB" if mib < 1024 else f"{mib >> 10} GiB"
            table.add_row(size, f"{mem:.2f}", f"{snap:.2f}", f"{snap / mem:.0%}", f"{grad:.2f}",
                          f"{one:.2f}", f"{threaded:.2f}", name)  # fmt: skip
        Console().print(table)
        for phase, samples in lat.items():
            p50, p99 = np.percentile(samples, [50, 99])
            print(f"micro-step claim (fetch-and-add), {phase}: p50 {p50:.1f} µs, p99 {p99:.1f} µs")
    t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256,1024", help="MiB, comma-separated")
    ap.add_argument("--claims", type=int, default=20000)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        worker(sizes, args.claims)
        return
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = ["mpirun", "--oversubscribe", "-n", "3", sys.executable, __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
