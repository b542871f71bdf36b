"""Where a cell's engine replicas run: one replica per tensor-parallel group of its GPUs.

```
 a cell of 8 ranks on 1 node, engine.tp_size = 4          a cell of 16 ranks on 2 nodes, tp 16
   node 0: GPUs 0-3 replica 0 (hosted by rank 0)            node 0: GPUs 0-7 replica 0, node rank 0
           GPUs 4-7 replica 1 (hosted by rank 4)                    (rank 0: it serves HTTP)
                                                            node 1: GPUs 0-7 replica 0, node rank 1
                                                                    (rank 8: --dist-init-addr node 0)
```

One rank per GPU. A replica within a node (``tp_size`` ≤ GPUs a node) is hosted by the rank at
its first GPU; a replica larger than a node spans ``tp_size / GPUs a node`` whole nodes, one part
per node, each part hosted by its node's first rank of the replica with ``--nnodes``,
``--node-rank`` and the head part's address. Only a head part serves HTTP and takes the weights;
where they go by reference, every part stages them on its own node for the head's request.
SGLang's ``--dp-size`` is no substitute: its weight-update verbs assert ``dp_size == 1``.

Pure: it knows nothing of processes, ports or hosts (``engines.sglang`` adds those). A recipe's
engines are checked here before launch (``cell_engines``, which ``launch.check`` calls), not
when the recipe is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.errors import RecipeError
from gyre_hpc.recipe.schema import CellsConfig, EngineConfig, SlurmConfig


@dataclass(frozen=True)
class EnginePart:
    """One engine process: the whole replica, or its share on one node."""

    replica: int
    """Index of the replica within its cell."""
    host_rank: int
    """The rank of the cell (0 = its leader) that starts and drives this part."""
    node: int
    """The cell's node it runs on (0 … slurm.nodes_per_cell - 1)."""
    base_gpu: int
    """Its first GPU on that node."""
    gpus: int
    """GPUs it uses on that node."""
    nnodes: int = 1
    """Nodes the replica spans (SGLang's --nnodes)."""
    node_rank: int = 0
    """This part's place among them (--node-rank); 0 is the head: HTTP and weights."""

    @property
    def head(self) -> bool:
        return self.node_rank == 0


@dataclass(frozen=True)
class EnginePlan:
    parts: tuple[EnginePart, ...]
    idle_gpus: int
    """GPUs of the cell no engine uses while it samples."""

    @property
    def replicas(self) -> int:
        return sum(p.head for p in self.parts)

    def weight_hosts(self, by_reference: bool = False) -> tuple[int, ...]:
        """The cell ranks whose engine parts take weights: each replica's head, and with
        ``by_reference`` every part (each stages them on its node)."""
        return tuple(sorted({p.host_rank for p in self.parts if p.head or by_reference}))

    def parts_of(self, replica: int) -> list[EnginePart]:
        """A replica's parts, in node order."""
        return sorted((p for p in self.parts if p.replica == replica), key=lambda p: p.node_rank)

    def hosted_by(self, rank: int) -> list[EnginePart]:
        return [p for p in self.parts if p.host_rank == rank]

    def describe(self) -> str:
        """One line per part (the recipe check and the job script print it)."""
        out = []
        for p in self.parts:
            gpus = f"GPU {p.base_gpu}" if p.gpus == 1 else f"GPUs {p.base_gpu}-{p.base_gpu + p.gpus - 1}"
            span = f", node rank {p.node_rank} of {p.nnodes}" if p.nnodes > 1 else ""
            out.append(f"replica {p.replica}: node {p.node} {gpus} (cell rank {p.host_rank}{span})")
        if self.idle_gpus:
            out.append(f"{self.idle_gpus} GPUs without an engine")
        return "\n".join(out)


def engine_plan(ranks_per_cell: int, nodes_per_cell: int, tp_size: int) -> EnginePlan:
    """Every engine part of one cell; a ``RecipeError`` (one line) for a layout no replica fits."""
    if ranks_per_cell % nodes_per_cell:
        raise RecipeError(
            f"cells.ranks_per_cell = {ranks_per_cell} must be a multiple of "
            f"slurm.nodes_per_cell = {nodes_per_cell}"
        )
    per_node = ranks_per_cell // nodes_per_cell
    parts: list[EnginePart] = []
    if tp_size <= per_node:
        fit = per_node // tp_size
        for node in range(nodes_per_cell):
            for k in range(fit):
                gpu = k * tp_size
                parts.append(EnginePart(len(parts), node * per_node + gpu, node, gpu, tp_size))
        return EnginePlan(tuple(parts), (per_node - fit * tp_size) * nodes_per_cell)
    if tp_size % per_node or nodes_per_cell % (tp_size // per_node):
        raise RecipeError(
            f"engine.tp_size = {tp_size} spans nodes of {per_node} GPUs: it must be a multiple of "
            f"{per_node} that divides the cell's {nodes_per_cell} nodes into whole replicas"
        )
    nnodes = tp_size // per_node
    for replica in range(nodes_per_cell // nnodes):
        for r in range(nnodes):
            node = replica * nnodes + r
            parts.append(EnginePart(replica, node * per_node, node, 0, per_node, nnodes, r))
    return EnginePlan(tuple(parts), 0)


def replica_capacity(capacity: int, replicas: int) -> int:
    """Calls one replica runs at once: its cell's ``cells.capacity`` shared by the cell's replicas."""
    return -(-capacity // replicas)


def check_engine_plan(plan: EnginePlan, allow_idle_gpus: bool) -> None:
    """A sampling cell whose GPUs are not all serving is refused unless the recipe allows it."""
    if plan.idle_gpus and not allow_idle_gpus:
        raise RecipeError(
            f"{plan.idle_gpus} GPUs of each cell would have no engine while it samples "
            "(cells.ranks_per_cell / slurm.nodes_per_cell is not a multiple of engine.tp_size); "
            "choose them so it is, or set engine.allow_idle_gpus = true"
        )


def cell_engines(cells: CellsConfig, slurm: SlurmConfig, engine: EngineConfig) -> EnginePlan:
    """A recipe's cell, placed: every replica fits its GPUs, none idle unless the recipe allows
    it, and its weights go by a path its devices accept. A replica that spans nodes takes them
    by reference with each part's rank staging them on its node (``engines.sglang.PartPush``),
    but not as deltas (each node would keep and check its own); on GPUs, none takes them by
    broadcast, whose group holds the cell leader's GPU twice (the leader, and the server's
    first rank on the same GPU), which NCCL refuses."""
    plan = engine_plan(cells.ranks_per_cell, slurm.nodes_per_cell, engine.tp_size)
    check_engine_plan(plan, engine.allow_idle_gpus)
    on_gpus = slurm.gpus_per_node > 0 or slurm.gpu_per_task
    if engine.backend == "sglang" and on_gpus and engine.weight_sync == "broadcast":
        raise RecipeError(
            'engine.weight_sync = "broadcast" on GPUs: the weight group would hold the cell '
            "leader's GPU twice (the leader and the server's first rank share it), which NCCL "
            'refuses; set engine.weight_sync = "tensor" (a replica within a node) or "disk"'
        )
    if any(p.nnodes > 1 for p in plan.parts) and engine.weight_sync == "delta":
        other = '"tensor" or "disk"' if on_gpus else '"tensor", "broadcast" or "disk"'
        raise RecipeError(
            f'engine.tp_size = {engine.tp_size} spans nodes: engine.weight_sync = "delta" is not '
            f"offered across nodes; set engine.weight_sync = {other}"
        )
    return plan
