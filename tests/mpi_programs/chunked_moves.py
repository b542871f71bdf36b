"""Model-sized buffers moved in parts (run under mpirun -n 3): the transport's snapshot and
gradient reads, each with 1 MiB parts of a 2.7 MB buffer.

rank 0 counts claims, rank 1 is the core, rank 2 a satellite. Writes a JSON verdict to argv[1].
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from gyre_hpc.transport.base import TransportPlan
from gyre_hpc.transport.mpi import MpiTransport

out = Path(sys.argv[1])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
n = 680_000  # float32: 2.72 MB, three 1 MiB parts
part = 1 << 20
want = np.random.default_rng(0).standard_normal(n).astype(np.float32)

transport = MpiTransport(comm, TransportPlan(n, core=1, counter=0, grads={2: n}), part_bytes=part)
if rank == 1:
    transport.publish(want, 7)
comm.Barrier()
snapshot, version, gradient = np.zeros(n, np.float32), -1, np.zeros(n, np.float32)
if rank == 2:
    version = transport.pull_snapshot(snapshot)
    transport.gradient_buffer()[:] = want * 2
comm.Barrier()
if rank == 1:
    transport.pull_gradient(2, gradient)
verdicts = comm.gather(
    {
        "rank": rank,
        "snapshot_equal": bool(np.array_equal(snapshot, want)) if rank == 2 else None,
        "version": version,
        "gradient_equal": bool(np.array_equal(gradient, want * 2)) if rank == 1 else None,
    },
    root=0,
)
comm.Barrier()
transport.close()
if rank == 0:
    out.write_text(json.dumps(verdicts))
