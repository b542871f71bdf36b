"""Rank 0 sends a large control message to rank 1, which is busy for 2 s; how long did send take?

mpirun -n 2 python channel_send.py VERDICT_JSON
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from gyre_hpc.runtime.protocol import Channel, Heartbeat, MicroSteps
from gyre_hpc.scheduler.policy import Role

BUSY_S = 2.0

comm = MPI.COMM_WORLD
channel = Channel(comm)
if comm.Get_rank() == 0:
    payload = [[np.zeros(1 << 20, dtype=np.float32)]]  # 4 MiB: far past any eager limit
    started = time.monotonic()
    channel.send(MicroSteps(step=1, items=payload), 1)
    send_s = time.monotonic() - started
    _, reply = channel.recv(30, 1)
    unsent = channel.flush(10)
    json.dump(
        {"send_s": send_s, "busy_s": BUSY_S, "reply": type(reply).__name__, "unsent": unsent},
        open(sys.argv[1], "w"),
    )
else:
    time.sleep(BUSY_S)  # a cell in the middle of a micro-step
    _, msg = channel.recv(30, 0)
    assert isinstance(msg, MicroSteps) and msg.items[0][0].nbytes == 4 << 20
    channel.send(Heartbeat(cell=1, role=Role.TRAINING, sent=time.time()), 0)
    channel.flush(10)
comm.Barrier()
