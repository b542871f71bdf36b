"""One optimizer step trained by the core alone, then by core + 2 satellites (run under mpirun -n 4).

rank 0 owns the claim counter (the controller's job), rank 1 is the core, ranks 2 and 3 are
satellites: rank 2 joins late, rank 3 is slow. Writes a JSON verdict to argv[2].
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from gyre_hpc.recipe.schema import TrainerConfig
from gyre_hpc.step.claims import Claims, work_once
from gyre_hpc.trainer.data_parallel import apply_on_core, pull_snapshot
from gyre_hpc.trainer.torch_backend import TorchTrainer
from gyre_hpc.trajectory.sequences import TrainSequence
from gyre_hpc.transport.base import TransportPlan
from gyre_hpc.transport.mpi import MpiTransport

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
config = TrainerConfig(lr=1e-4, grad_clip=0.0)


def batch(seed: int, vocab: int) -> list[list[TrainSequence]]:
    rng = np.random.default_rng(seed)
    queue = []
    for m in range(12):
        seqs = []
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(20, 70))
            mask = rng.random(n) < 0.5
            mask[0] = False
            seqs.append(
                TrainSequence(
                    f"run{m % 5}",
                    rng.integers(0, vocab, n).astype(np.int32),
                    mask,
                    np.where(mask, -rng.random(n) * 3 - 4, 0).astype(np.float32),
                    float(rng.normal()),
                    1.0 / 200,
                )
            )
        queue.append(seqs)
    return queue


probe = TorchTrainer(model_dir, config, core=False)
numel, vocab = probe.numel, probe.model.config.vocab_size
queue = batch(7, vocab)
runs = 5
plan = TransportPlan(numel, core=1, counter=0, grads=dict.fromkeys((1, 2, 3), numel))
transport = MpiTransport(comm, plan)

reference = None
if rank == 1:  # the core alone, all micro-steps in order
    alone = TorchTrainer(model_dir, config, core=True)
    for seqs in queue:
        alone.micro_step(seqs)
    reference_grad = alone.gradient().copy() / runs
    alone.apply(runs)
    reference = alone.weights().copy()

trainer = TorchTrainer(
    model_dir, config, core=rank == 1, grad_buffer=transport.gradient_buffer() if rank else None
)
if rank == 1:
    transport.publish(trainer.weights(), 0)
comm.Barrier()

claimed: list[int] = []
if rank >= 1:
    if rank > 1:
        pull_snapshot(trainer, transport, 0, np.empty(numel, np.float32))
    if rank == 2:
        time.sleep(0.5)  # joins after the others have started
    pace = {1: 0.1, 2: 0.1, 3: 0.4}[rank]  # rank 3 is a slow cell
    claims = Claims.of(queue)  # a complete queue, claimed until exhausted, as a cell does
    while True:
        time.sleep(pace)
        if work_once(claims, trainer, transport) == "done":
            break
    claimed = claims.claimed
all_claimed = comm.gather(claimed, root=0)
comm.Barrier()  # every satellite has reported: its gradient is final

if rank == 1:
    summed = trainer.gradient().copy()
    scratch = np.empty(numel, np.float32)
    for r in (2, 3):
        transport.pull_gradient(r, scratch)
        summed += scratch
    stats = apply_on_core(trainer, transport, (2, 3), runs)
    grad_err = float(np.abs(summed / runs - reference_grad).max() / np.abs(reference_grad).max())
    weight_err = float(np.abs(trainer.weights() - reference).max())
    comm.send((grad_err, weight_err, stats.version), dest=0)
if rank == 0:
    grad_err, weight_err, version = comm.recv(source=1)
    out.write_text(
        json.dumps(
            {
                "claimed": all_claimed[1:],
                "micro_steps": len(queue),
                "grad_rel_err": grad_err,
                "weight_max_abs_err": weight_err,
                "version": version,
            }
        )
    )
transport.close()
