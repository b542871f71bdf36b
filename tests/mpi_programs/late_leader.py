"""One rank of a two-rank replica joining its rendezvous, rank 0 after ``delay`` seconds (as a
cell's leader does once its engine is up).

python late_leader.py RANK PORT DELAY_S START_TIMEOUT_S HEARTBEAT_TIMEOUT_S
"""

import sys
import time
import warnings

warnings.filterwarnings("ignore")

from gyre_hpc.recipe.schema import CellsConfig, EngineConfig  # noqa: E402
from gyre_hpc.runtime.cell_host import rendezvous_timeout_s  # noqa: E402
from gyre_hpc.trainer.megatron_backend import MegatronWorld, RendezvousTimeout, init_megatron  # noqa: E402

rank, port, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
wait = rendezvous_timeout_s(
    EngineConfig(start_timeout_s=float(sys.argv[4])), CellsConfig(heartbeat_timeout_s=float(sys.argv[5]))
)
if rank == 0:
    time.sleep(delay)  # the engine starting
started = time.monotonic()
try:
    init_megatron(MegatronWorld(rank, 2, "127.0.0.1", port, timeout_s=wait), tp=2, pp=1, seed=0)
except RendezvousTimeout as err:
    print(f"{err} after {time.monotonic() - started:.1f} s", file=sys.stderr)
    sys.exit(3)
print(f"rank {rank} up after {time.monotonic() - started:.1f} s")
