"""A megatron trainer over DP × TP × PP ranks (experts over EP of them): one micro-step and one
update, recorded by rank 0, with what each rank holds: its (stage, TP rank, DP rank), the sizes of
its whole-model host buffers, and the values its parameters, fp32 masters and Adam moments hold.
Then each rank writes its checkpoint shard into ``shards/`` beside OUT_NPZ, forgets its weights,
and reads them back.

mpirun -n DP·TP·PP python megatron_parallel.py MODEL_DIR OUT_NPZ TP PP [PACKING [SEQUENCES [EP]]]
mpirun -n N python megatron_parallel.py --cases CASES.json

With PACKING ``tree`` the micro-step is the forked sequences of ``test_tree_packing``, packed.
SEQUENCES: how many of ``test_megatron_backend.sequences`` (fewer than the replicas: some
replica's share is empty). ``--cases``: a list of such cases (model, out, tp, pp, packing,
count, ep), one after another in this one world, megatron's parallel state made anew for each:
a rank's start-up (torch, megatron-core, transformers) is most of a case's time.
"""

import dataclasses
import gc
import json
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from test_megatron_backend import CFG, sequences  # noqa: E402
from test_tree_packing import forked_sequences  # noqa: E402

from gyre_hpc.models.architecture import ModelConfig  # noqa: E402
from gyre_hpc.trainer.megatron_backend import MegatronTrainer, MegatronWorld  # noqa: E402

comm = MPI.COMM_WORLD
sys.excepthook = lambda *exc: (traceback.print_exception(*exc), comm.Abort(1))  # no rank waits forever
rank, size = comm.Get_rank(), comm.Get_size()


def run(
    model_dir: Path, out: str, tp: int, pp: int, packing: str, count: int, ep: int, world: MegatronWorld
) -> None:
    trainer = MegatronTrainer(
        model_dir,
        dataclasses.replace(CFG, tp_size=tp, pp_size=pp, ep_size=ep),
        core=True,
        world=world,
        packing=packing,
    )
    before = trainer.weights().copy()
    config = ModelConfig.load(model_dir)
    vocab = config.vocab_size
    seqs = forked_sequences(vocab) if packing == "tree" else sequences(vocab, count, routed=config)
    stats = trainer.micro_step(seqs)
    grad = trainer.hf_gradient().copy()
    norm = trainer.apply(3).grad_norm
    after = trainer.weights().copy()
    params = sum(p.numel() for p in trainer.params.values())
    state = sum(t.numel() for s in trainer.optimizer.state.values() for t in s.values() if t.dim())
    shards = Path(out).parent / "shards"
    digests = comm.gather(trainer.save_weights(shards, rank), root=0)
    comm.Barrier()  # every shard written before any is read back
    with torch.no_grad():  # forgotten: what comes back is read from the shard
        for t in [*trainer.params.values(), *(trainer.master or {}).values()]:
            t.zero_()
    trainer.load_weights(shards, 9, rank)
    reloaded = trainer.weights().copy()
    held = (
        trainer.stage,
        trainer.tp_rank,
        trainer.dp_rank,
        trainer.flat.size,
        trainer.grad.size,
        params,
        state,
    )
    held = comm.gather(held, root=0)
    if rank == 0:
        np.savez(out, before=before, grad=grad, norm=norm, after=after, loss=stats.loss_sum,
                 clipped=stats.clipped, tokens=stats.tokens, held=np.array(held), reloaded=reloaded,
                 digests=json.dumps({k: v for d in digests for k, v in d.items()}))  # fmt: skip
    comm.Barrier()


port = comm.bcast(MegatronWorld.alone().port if rank == 0 else None, root=0)
world = MegatronWorld(rank, size, "127.0.0.1", port)
if sys.argv[1] == "--cases":
    from megatron.core import parallel_state

    for case in json.loads(Path(sys.argv[2]).read_text()):
        run(Path(case["model"]), case["out"], case["tp"], case["pp"], case["packing"], case["count"],
            case["ep"], world)  # fmt: skip
        parallel_state.destroy_model_parallel()  # the next case's layout is made anew
        gc.collect()
else:
    args = sys.argv[1:] + ["paths", "3", "1"][len(sys.argv) - 5 :]
    run(Path(args[0]), args[1], int(args[2]), int(args[3]), args[4], int(args[5]), int(args[6]), world)
