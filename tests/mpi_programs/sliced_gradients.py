"""Two megatron cells of TP × PP × DP ranks sum their gradients slice by slice over the transport,
as a run's core and satellite do: each trains half the micro-steps, each rank of the core pulls
its counterpart's slice, the norm is all-reduced from the slices, the core steps. Then each core
rank publishes its weight slice and its counterpart loads it, as a satellite joins the next step.
Rank 0 holds the claim counter, as the controller does; the core's leader writes what the core
ended with, the satellite's what it loaded.

mpirun -n 1+2·TP·PP·DP python sliced_gradients.py MODEL_DIR OUT_NPZ TP PP [DTYPE]
mpirun -n 1+2·TP·PP·DP python sliced_gradients.py --cases CASES.json

``--cases``: a list of such cases (model, out, tp, pp, dtype) of one world size, one after another
in this one world, each with its own transport and megatron's parallel state made anew: a rank's
start-up (torch, megatron-core, transformers) is most of a case's time.
"""

import dataclasses
import gc
import json
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from test_megatron_backend import CFG, sequences  # noqa: E402

from gyre_hpc.launch.ports import free_port  # noqa: E402
from gyre_hpc.models.architecture import ModelConfig  # noqa: E402
from gyre_hpc.plan.ranks import RankLayout  # noqa: E402
from gyre_hpc.runtime.main import transport_plan  # noqa: E402
from gyre_hpc.trainer.data_parallel import add_gradients, publish_slice, pull_slice  # noqa: E402
from gyre_hpc.transport.mpi import MpiTransport  # noqa: E402

comm = MPI.COMM_WORLD
sys.excepthook = lambda *exc: (traceback.print_exception(*exc), comm.Abort(1))  # no rank waits forever
rank, size = comm.Get_rank(), comm.Get_size()


def run(model_dir: Path, out: str, tp: int, pp: int, dtype: str) -> None:
    config = dataclasses.replace(CFG, backend="megatron", tp_size=tp, pp_size=pp, grad_clip=1e-3, dtype=dtype)
    layout = RankLayout(cells=2, ranks_per_cell=(size - 1) // 2)
    plan = transport_plan(layout, model_dir, config)
    transport = MpiTransport(comm, plan, part_bytes=1 << 16)  # many parts: the path a large slice takes
    unit = layout.unit_of(rank)
    cell = comm.Split(layout.cells if unit is None else unit, rank)
    if unit is not None:
        from gyre_hpc.trainer.megatron_backend import MegatronTrainer, MegatronWorld

        port = cell.bcast(free_port("127.0.0.1") if cell.Get_rank() == 0 else None, root=0)
        world = MegatronWorld(cell.Get_rank(), cell.Get_size(), "127.0.0.1", port)
        exposed = None if unit == 0 else transport.gradient_buffer()
        trainer = MegatronTrainer(model_dir, config, core=unit == 0, grad_buffer=exposed, world=world)
        assert trainer.grad.size == plan.grads.get(rank, trainer.grad.size)  # the plan cuts as megatron does
        seqs = sequences(ModelConfig.load(model_dir).vocab_size, 4)
        trainer.micro_step(seqs[:2] if unit == 0 else seqs[2:])
        trainer.gradient()
    comm.Barrier()  # the satellite's slices are final
    counterpart = layout.ranks_of(1 - unit)[cell.Get_rank()] if unit is not None else None
    if unit == 0:
        add_gradients(trainer, transport, [layout.leader(1) + cell.Get_rank()])
        norm = trainer.apply(3).grad_norm
        after = trainer.weights()
        if cell.Get_rank() == 0:
            np.savez(out, after=after, norm=norm)
        publish_slice(trainer, transport)
        comm.send(trainer.weight_slice(), dest=counterpart)  # to check the one-sided read against
    if unit == 1:
        sent = comm.recv(source=counterpart)
    comm.Barrier()  # every slice published
    if unit == 1:
        pull_slice(trainer, transport, counterpart, 1)
        mine = trainer.weight_slice()
        assert trainer.version == 1 and np.array_equal(mine, sent), "the slice loaded is not the core's"
        loaded = trainer.weights()
        sizes = cell.gather((mine.size, plan.slices[counterpart]), root=0)
        if cell.Get_rank() == 0:
            np.savez(Path(out).with_suffix(".satellite.npz"), weights=loaded, sizes=np.array(sizes))
    registered = comm.gather(
        (transport._snap.nbytes, transport._slice.nbytes, transport._grad.nbytes), root=0
    )
    if rank == 0:
        np.save(Path(out).with_suffix(".registered.npy"), np.array(registered))
    comm.Barrier()
    transport.close()

    if unit is not None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()  # the next case's layout is made anew (one cell world)
    cell.Free()
    gc.collect()


if sys.argv[1] == "--cases":
    for case in json.loads(Path(sys.argv[2]).read_text()):
        run(Path(case["model"]), case["out"], case["tp"], case["pp"], case["dtype"])
else:
    run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), (sys.argv[5:] or ["float32"])[0])
