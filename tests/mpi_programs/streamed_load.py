"""A megatron replica over TP × PP ranks pushes its weights into a real SGLang server, whole
tensors gathered from the ranks' slices one at a time and staged a bucket at a time (what a cell
whose leader hosts its engine does): versions 1 to 3.
Rank 0 records what it staged at most, the largest tensor, what each push moved, and each rank's
whole-model buffer (none may be made). Version 1 goes by reference, versions 2 and 3 as deltas
(2 whole through the delta loader, 3 as the 1 % that changed).

mpirun -n TP·PP python streamed_load.py MODEL_DIR OUT_NPZ TP PP URL BUCKET_BYTES
"""

import dataclasses
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from test_megatron_backend import CFG  # noqa: E402

from gyre_hpc.engines.sglang import TensorPush, call  # noqa: E402
from gyre_hpc.models.architecture import ModelConfig  # noqa: E402
from gyre_hpc.models.flat import FlatLayout  # noqa: E402
from gyre_hpc.trainer.megatron_backend import MegatronTrainer, MegatronWorld  # noqa: E402

comm = MPI.COMM_WORLD
sys.excepthook = lambda *exc: (traceback.print_exception(*exc), comm.Abort(1))  # no rank waits forever
rank, size = comm.Get_rank(), comm.Get_size()
model_dir, out, tp, pp = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
url, bucket = sys.argv[5], int(sys.argv[6])
port = comm.bcast(MegatronWorld.alone().port if rank == 0 else None, root=0)
trainer = MegatronTrainer(
    model_dir,
    dataclasses.replace(CFG, tp_size=tp, pp_size=pp),
    core=False,
    world=MegatronWorld(rank, size, "127.0.0.1", port),
)
layout = FlatLayout.of(ModelConfig.load(model_dir))


def moved(seed: int, fraction: float) -> None:
    """Every rank moves its own slice (the same elements of a tensor on every rank that holds a
    copy of it): no whole model anywhere."""
    with torch.no_grad():
        for name, p in trainer.params.items():
            g = torch.Generator().manual_seed(seed * 1000 + sorted(trainer.params).index(name))
            mask = torch.rand(p.shape, generator=g) < fraction
            p.add_(mask * torch.randn(p.shape, generator=g) * 0.02)


by_reference = TensorPush(url, layout, 1, "cpu", "float32", bucket) if rank == 0 else None
delta = TensorPush(url, layout, 1, "cpu", "float32", bucket, delta=True) if rank == 0 else None
pushed = []
for version, fraction, push in ((1, 1.0, by_reference), (2, 1.0, delta), (3, 0.01, delta)):
    moved(version, fraction)
    tensors = trainer.hf_tensors()
    if rank == 0:
        call(url, lambda c: c.begin_weight_update())
        p = push.push(tensors, version)
        call(url, lambda c: c.end_weight_update())
        pushed.append((p.sent, p.whole, p.changed if p.changed is not None else -1, p.elements))
    else:
        for _ in tensors:
            pass
whole = comm.gather(trainer.flat.size, root=0)  # before weights() makes the leader's, below
served = trainer.weights().copy()  # what the server should now serve (for the comparison only)
if rank == 0:
    largest = max(shape.numel() for _, shape in layout.slots.values()) * 4
    np.savez(out, peak=by_reference.peak_bytes, largest=largest, pushed=np.array(pushed),
             whole=np.array(whole), served=served)  # fmt: skip
comm.Barrier()
