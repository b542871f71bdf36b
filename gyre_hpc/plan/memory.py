"""The memory plan of a cell: what one GPU holds while its cell samples and while it trains.

A pure function of the model's shape, the engine and trainer sections and the GPU's size
(``cells.gpu_memory_gib``). ``gyre-hpc recipe check`` prints it; ``check``, ``run`` and
``submit`` refuse, in one line with the numbers, a recipe one of whose phases does not fit.

```
 sampling (engine resumed, trainer released)   training (engine released, trainer resident)
 ┌───────────────────────────────────────┐     ┌───────────────────────────────────────┐
 │ engine static pool: mem_fraction ×    │     │ trainer: weights, gradients (+ fp32    │
 │   GPU = its weights + KV cache        │     │   accumulation), on the core the fp32  │
 │ engine workspace (decode, graphs)     │     │   master copy and Adam's two moments   │
 │ staged weight bucket (sent, received) │     │ activations of one micro-step          │
 │ trainer, released: its CUDA context   │     │ logits of one chunk of rows (last st.) │
 └───────────────────────────────────────┘     │ engine, released: its CUDA context     │
                                               └───────────────────────────────────────┘
```

The worst GPU of a cell is planned: one that hosts a trainer rank and an engine rank, on the
core (cell 0, which steps the optimizer), on the pipeline stage that holds the most. A
micro-step's tokens are planned as if one replica got all ``trainer.micro_step_tokens`` (a run's
tree is never split across replicas, so one may).

What this module does not know: the allocator's fragmentation, SGLang's own choice of CUDA-graph
batch sizes, the kernels' scratch space. Those are the documented constants below (estimates;
``tools/gpu_bench.sh`` measures the colocation cycle they stand for). It counts bytes; it
allocates nothing and reads no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gyre_hpc.errors import RecipeError
from gyre_hpc.models.architecture import ModelConfig
from gyre_hpc.recipe.schema import AgentConfig, CellsConfig, EngineConfig, TrainerConfig

GIB = 1 << 30
CUDA_CONTEXT = 1 * GIB
"""One process's CUDA context, cuBLAS and NCCL workspaces: what a released side still holds."""
ENGINE_WORKSPACE = 4 * GIB
"""An engine's memory beyond its static pool: a decode batch's activations and CUDA graphs."""
IPC_CONTEXT = GIB // 2
"""A CUDA context another process opens on this GPU to read a bucket staged here by CUDA IPC
(each SGLang TP rank but the first, for the life of the server; an estimate)."""
LOGIT_BYTES = 16
"""Bytes per logit of one chunk of rows on the last stage (``trainer.logprob_chunk``,
``loss.vocab_logprobs``): the fp32 logits and the few fp32 temporaries of their softmax or its
gradient that exist at once; no chunk outlives its turn."""
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Part:
    """One thing a GPU holds, in bytes."""

    what: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Phase:
    """What one GPU holds while its cell is in one role."""

    name: str
    parts: tuple[Part, ...]

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def line(self) -> str:
        parts = ", ".join(f"{p.what} {gib(p.bytes)}" for p in self.parts if p.bytes)
        return f"{self.name} {gib(self.total)} GiB ({parts})"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The plan of the worst GPU of a cell, and what the engine's KV cache then holds."""

    gpu_bytes: int
    model: str
    """The model's family and parameters (total, and active a token where experts are routed)."""
    sampling: Phase
    training: Phase
    start_up: Phase
    """The core's worst GPU while its trainer is built and restored beside the engine's pool."""
    micro_step_tokens: int
    """The longest micro-step: ``trainer.micro_step_tokens``, or one context if that is longer."""
    kv_tokens: int
    """Tokens of KV one engine replica holds in its static pool after its weights."""
    context_tokens: int
    """Tokens one execution's context may reach (agent.context_limit_tokens + one reply)."""
    host_leader: int
    """Host memory of the core's leader: its released trainer slice and that slice's gradient,
    its engine's copy, and either a bucket staged with the largest tensor (megatron cells stream
    their engines' weights from their slices) or the whole flat weights and the published
    snapshot (the transport's)."""
    host_member: int = 0
    """Host memory of a member: its released trainer slice and that slice's gradient."""
    host_engine_member: int = 0
    """Host memory of a member that hosts an engine replica: its slice and gradient, its engine's
    copy, and a bucket staged with the largest tensor (streamed) or the snapshot it pulls whole."""
    engine_members: int = 0
    """Members of the leader's node that host an engine replica."""
    ranks_per_node: int = 1
    """A cell's ranks on one node (``cells.ranks_per_cell`` / ``slurm.nodes_per_cell``)."""
    node_host_bytes: int = 0
    """One node's host memory (``cells.host_memory_gib``); 0: not planned."""
    experts: bool = False
    """The model routes experts: ``trainer.ep_size`` splits them."""
    route_bytes: int = 0
    """Bytes the TITO log keeps a token for its routed experts (routing replay; 0: none kept)
    against the 4 of its id; in the controller's memory too, while its run's tree is held."""

    @property
    def host_node(self) -> int:
        """The host memory of the core's first node: its leader, and its members."""
        others = self.ranks_per_node - 1 - self.engine_members
        return self.host_leader + self.engine_members * self.host_engine_member + others * self.host_member

    def host_line(self) -> str:
        n, k = self.ranks_per_node, self.engine_members
        ranks = f"{n} rank{'s' if n != 1 else ''}"
        parts = [f"leader {gib(self.host_leader)}"]
        if n > 1 + k:
            parts.append(f"{n - 1 - k} × {gib(self.host_member)}")
        if k:
            parts.append(f"{k} × {gib(self.host_engine_member)} hosting an engine replica")
        return f"host {gib(self.host_node)} GiB a node of {ranks} ({', '.join(parts)})"

    def lines(self) -> list[str]:
        return [
            f"memory plan, the worst GPU of a cell ({gib(self.gpu_bytes)} GiB), {self.model}:",
            f"  {self.sampling.line()}",
            f"  {self.training.line()}, a micro-step of {self.micro_step_tokens:,} tokens",
            f"  {self.start_up.line()}",
            f"  KV cache {self.kv_tokens:,} tokens a replica (one context: {self.context_tokens:,})",
            f"  {self.host_line()}" + (f", of {gib(self.node_host_bytes)}" if self.node_host_bytes else ""),
            *self.routes_line(),
        ]

    def routes_line(self) -> list[str]:
        if not self.route_bytes:
            return []
        run = self.route_bytes * self.context_tokens
        return [
            f"  routes (routing replay): {self.route_bytes:,} B a token in the TITO log and the controller "
            f"(its id: 4 B), {run / 2**20:,.0f} MiB one context; SGLang's host pool of them counted above"
        ]

    def refusal(self) -> str | None:
        """Why the recipe cannot run on these GPUs (one line with the numbers), or None."""
        for phase in (self.sampling, self.training, self.start_up):
            if phase.total > self.gpu_bytes:
                sizes = "trainer.tp_size / trainer.pp_size" + (" / trainer.ep_size" if self.experts else "")
                advice = ADVICE[phase.name].format(sizes=sizes)
                return (
                    f"memory plan: {phase.line()} > {gib(self.gpu_bytes)} GiB, cells.gpu_memory_gib; {advice}"
                )
        if self.node_host_bytes and self.host_node > self.node_host_bytes:
            return (
                f"memory plan: {self.host_line()} > {gib(self.node_host_bytes)} GiB, "
                "cells.host_memory_gib; put fewer of a cell's ranks on a node (slurm.nodes_per_cell)"
            )
        if self.kv_tokens < self.context_tokens:
            return (
                f"memory plan: the engine's KV cache holds {self.kv_tokens:,} tokens after its weights, "
                f"less than one context ({self.context_tokens:,} = agent.context_limit_tokens + "
                f"engine.max_new_tokens); raise engine.mem_fraction_static or engine.tp_size"
            )
        return None


ADVICE = {
    "sampling": "lower engine.mem_fraction_static or engine.weight_bucket_mb",
    "training": 'set trainer.recompute = "full", lower trainer.micro_step_tokens or '
    "agent.context_limit_tokens (a longer path is a micro-step of its own), or raise {sizes}",
    "start-up": "lower engine.mem_fraction_static, or raise {sizes}",
}
"""What to change when a phase does not fit; ``{sizes}``: the parallel sizes that cut the model."""


def gib(n: int) -> str:
    """GiB with one decimal; three significant digits below a tenth (a tiny model's parts)."""
    return f"{n / GIB:.1f}" if n >= GIB // 10 else f"{n / GIB:.3g}"


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes the plan needs, from any family's config (``models.architecture``)."""

    layers: int
    hidden: int
    q: int
    """Query width: heads × head_dim."""
    kv: int
    """Key (or value) width: kv_heads × head_dim."""
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    experts: int = 0
    """Routed experts a layer (0: a dense MLP of ``ffn``)."""
    active: int = 0
    """Experts a token is routed to."""
    expert_ffn: int = 0
    qk_norm: bool = True
    """Per-head RMSNorm of queries and keys (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""

    @classmethod
    def of(cls, c: ModelConfig) -> Shape:
        hd = c.head_dim
        return cls(
            c.num_hidden_layers, c.hidden_size, c.num_attention_heads * hd, c.num_key_value_heads * hd,
            c.num_key_value_heads, hd, c.intermediate_size, c.vocab_size, c.tie_word_embeddings,
            c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            qk_norm=c.qk_norm, qkv_bias=c.qkv_bias,
        )  # fmt: skip

    def _layer(self, experts: int) -> int:
        h = self.hidden
        attention = h * (self.q + 2 * self.kv) + self.q * h
        attention += 2 * self.head_dim if self.qk_norm else 0
        attention += self.q + 2 * self.kv if self.qkv_bias else 0
        mlp = experts * 3 * h * self.expert_ffn + h * self.experts if self.experts else 3 * h * self.ffn
        return attention + mlp + 2 * h

    @property
    def layer_params(self) -> int:
        return self._layer(self.experts)

    @property
    def layer_expert_params(self) -> int:
        """A layer's routed experts (0 where dense): split over ``trainer.ep_size`` ranks, whole on each."""
        return self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.embedding_params + head + self.hidden

    @property
    def active_params(self) -> int:
        """What one token computes with: its ``active`` experts of each layer (all, where dense)."""
        head = 0 if self.tied else self.embedding_params
        return self.layers * self._layer(self.active) + self.embedding_params + head + self.hidden

    @property
    def mlp_tensor(self) -> int:
        """Elements of a layer's largest tensor as it moves: its [gate | up] projection, or one
        expert's (a layer's experts, fused where transformers keeps them, move an expert at a
        time: ``models.flat.piece``)."""
        return 2 * (self.expert_ffn if self.experts else self.ffn) * self.hidden

    @property
    def largest_tensor(self) -> int:
        return max(self.embedding_params, self.mlp_tensor)

    def kv_bytes_per_token(self, itemsize: int, tp: int = 1) -> int:
        """Keys and values one token leaves in one engine rank's cache (fewer kv heads than
        ranks: each rank keeps one)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * itemsize

    def layer_activation_elements(self, tp: int) -> int:
        """Elements one token leaves saved for backward in one layer, on one tensor-parallel rank:
        the two norms' inputs and outputs, and its share of q, k, v (before and after their
        norms), the attention output, the MLP's [gate | up] and its product. Dense: the norms'
        whole on every rank. Routed experts: under sequence parallelism (what megatron trains
        them beside TP with) a rank keeps 1/tp of the positions, and each of them routed to
        ``active`` experts, whole on their rank: its copy sent there, [gate | up] and product,
        with the router's logits."""
        if self.experts:
            routed = self.experts + self.active * (self.hidden + 3 * self.expert_ffn)
            return (4 * self.hidden + 3 * self.q + 3 * self.kv + routed) // tp
        return 4 * self.hidden + (3 * self.q + 3 * self.kv + 3 * self.ffn) // tp

    def line(self, c: ModelConfig) -> str:
        active = f" ({self.active_params / 1e9:.2f}B active a token)" if self.experts else ""
        return f"model {c.model_type}, {self.params / 1e9:.2f}B parameters{active}"


def plan(
    model: ModelConfig,
    cells: CellsConfig,
    engine: EngineConfig,
    trainer: TrainerConfig,
    agent: AgentConfig,
    nodes_per_cell: int = 1,
) -> MemoryPlan | None:
    """The plan of the worst GPU of a cell, or None where nothing is planned: no GPU size given
    (``cells.gpu_memory_gib = 0``), or an emulated engine or trainer (which hold no GPU memory).
    ``nodes_per_cell``: the nodes a cell's ranks spread over (``slurm.nodes_per_cell``)."""
    if not cells.gpu_memory_gib or "emulated" in (engine.backend, trainer.backend):
        return None
    s = Shape.of(model)
    gpu = int(cells.gpu_memory_gib * GIB)
    # megatron pads the vocabulary to a multiple of 128 × tp (``megatron_weights.MegatronLayout``)
    step = 128 * trainer.tp_size if trainer.backend == "megatron" else 1
    t = replace(s, vocab=-(-s.vocab // step) * step)
    tp, pp, ep = trainer.tp_size, trainer.pp_size, trainer.ep_size
    replay = trainer.routing_replay and bool(t.experts)
    # Where the engine serves its static pool holds its weights; the rest is KV cache.
    static = int(engine.mem_fraction_static * gpu)
    served = BYTES[engine_dtype(engine)]
    engine_weights = s.params * served // engine.tp_size
    kv_per_token = s.kv_bytes_per_token(served, engine.tp_size)
    bucket = engine.weight_bucket_mb << 20
    by_reference = engine.backend == "sglang" and engine.weight_sync in ("tensor", "delta")
    per_node = -(-cells.ranks_per_cell // nodes_per_cell)
    # a replica's server ranks on this node read buckets staged on its GPU; those on other nodes
    # read their own node's copy (``engines.sglang.PartPush``)
    readers = min(engine.tp_size, per_node) - 1 if by_reference else 0
    sampling = Phase(
        "sampling",
        (
            Part("engine static pool", static),
            Part("engine workspace", ENGINE_WORKSPACE),
            Part("weight bucket sent and received", 2 * bucket),
            Part("released trainer", CUDA_CONTEXT),
            Part("server ranks' IPC contexts", readers * IPC_CONTEXT),
        ),
    )
    train_dtype = BYTES[trainer.dtype]
    context = agent.context_limit_tokens + engine.max_new_tokens
    # A path longer than a micro-step is a micro-step of its own (``trajectory.batch``): the
    # longest a recipe allows is one whole context.
    tokens = max(trainer.micro_step_tokens, context)
    stages, starts = [], []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        layers = t.layers // pp
        params = layers * (t.layer_params - t.layer_expert_params) + (t.embedding_params if first else 0)
        params += t.embedding_params if last and (not t.tied or pp > 1) else 0
        # the dense part cut over TP; each rank's experts whole (megatron's expert TP is 1)
        params = params // tp + layers * t.layer_expert_params // ep
        state = Part("weights", params * train_dtype)
        # megatron: each backward's gradient in the parameters' dtype, summed in fp32; torch: fp32.
        grads = Part("gradients", params * (train_dtype + 4 if trainer.backend == "megatron" else 4))
        master = 4 * params if trainer.dtype != "float32" else 0
        optimizer = Part("fp32 master + Adam", master + 8 * params)
        if trainer.recompute == "full":
            # Each layer's input is kept; one layer's activations exist again while it is recomputed.
            saved = layers * t.hidden + t.layer_activation_elements(tp)
        else:
            saved = layers * t.layer_activation_elements(tp)
        # context parallelism (``trainer.cp_size``, planned though not run here) splits positions
        cp = trainer.cp_size
        activations = Part("activations", -(-tokens // cp) * saved * train_dtype)
        # a chunk of rows' logits at a time, and the output layer's gradient summed in fp32 over them
        shard = -(-t.vocab // tp)
        rows = min(trainer.logprob_chunk, -(-tokens // cp))
        logits = Part("logits", (rows * LOGIT_BYTES + t.hidden * 4) * shard if last else 0)
        # one layer's token exchange in flight: its positions' copies, each routed to ``active``
        # experts, sent and received (megatron's all-to-all dispatcher)
        exchange = 2 * tokens // tp * t.active * t.hidden * train_dtype if t.experts else 0
        # the routes replayed, int64 a choice, for this stage's layers
        replayed = tokens * layers * t.active * 8 if replay else 0
        parts = (state, grads, optimizer, activations, logits, Part("all-to-all buffers", exchange),
                 Part("replayed routes", replayed), Part("released engine", CUDA_CONTEXT))  # fmt: skip
        stages.append(Phase("training", parts))
        # The trainer is built, and the core restores and publishes, while the engine already
        # holds its pool: its weights and fp32 masters, and the largest tensor gathered whole in
        # fp32 (the shards, then their concatenation). Restored optimizer state stays on the host.
        # (an expert's copies from the ranks of its expert-parallel group, stacked nowhere)
        mlp = ep * t.mlp_tensor if t.experts else 2 * t.mlp_tensor
        gathered = 4 * max(2 * t.embedding_params if first or last else 0, mlp)
        starts.append(Phase("start-up", (
            Part("engine static pool", static), Part("engine workspace", ENGINE_WORKSPACE),
            state, Part("fp32 master", master), Part("largest tensor gathered", gathered),
            Part("trainer", CUDA_CONTEXT),
        )))  # fmt: skip
    training = max(stages, key=lambda p: p.total)
    start_up = max(starts, key=lambda p: p.total)
    # A rank's slice while released (the core's: weights, fp32 masters, Adam's moments) and its
    # fp32 gradient slice. Megatron cells stream their engines' weights from their slices
    # (``runtime.main.transport_plan``): a rank hosting a replica stages a bucket and the largest
    # tensor, whole in fp32, no more. With torch cells, or standalone engines that need them
    # whole, the leader holds whole fp32 buffers (its trainer's weights, the core's published
    # snapshot), and a member hosting an engine replica pulls a snapshot whole.
    rank_params = (t.params - t.layers * t.layer_expert_params) // (
        tp * pp
    ) + t.layers * t.layer_expert_params // (pp * ep)
    state = rank_params * (train_dtype + (4 if trainer.dtype != "float32" else 0) + 8 + 4)
    streams = trainer.backend == "megatron" and not cells.rollout_pool
    largest = 4 * s.largest_tensor
    whole = 0 if streams else 4 * s.params
    staging = bucket + largest if streams else 0
    # delta: the version each side last held, in the served dtype: the sender's (a rank hosting
    # a replica), and the server rank's on this GPU (at tp > 1 nearly all of it: sharded).
    engine_copy = 2 * s.params * served if engine.weight_sync == "delta" else 0
    heads = per_node // engine.tp_size if engine.tp_size <= per_node else 1  # the leader's node
    # SGLang keeps every KV slot's routed experts on the host, int32, in each server rank
    kv_tokens = max(0, static - engine_weights) // kv_per_token
    sglang = replay and engine.backend == "sglang"
    route_pool = kv_tokens * t.layers * t.active * 4 * min(engine.tp_size, per_node) if sglang else 0
    return MemoryPlan(
        gpu_bytes=gpu,
        model=s.line(model),
        sampling=sampling,
        training=training,
        start_up=start_up,
        micro_step_tokens=tokens,
        kv_tokens=kv_tokens,
        context_tokens=context,
        host_leader=state + 2 * whole + staging + engine_copy + route_pool,
        host_member=state,
        host_engine_member=state + whole + staging + engine_copy + route_pool,
        engine_members=max(0, heads - 1),
        ranks_per_node=per_node,
        node_host_bytes=int(cells.host_memory_gib * GIB),
        experts=bool(t.experts),
        route_bytes=t.layers * t.active * (1 if t.experts <= 256 else 2) if replay else 0,
    )


def engine_dtype(engine: EngineConfig) -> str:
    """The served dtype: auto is what the engine picks for a float32 or bfloat16 checkpoint (SGLang: its
    bfloat16; the embedded engine: float32)."""
    if engine.dtype != "auto":
        return engine.dtype
    return "bfloat16" if engine.backend == "sglang" else "float32"


def check_memory(
    model: ModelConfig | None,
    cells: CellsConfig,
    engine: EngineConfig,
    trainer: TrainerConfig,
    agent: AgentConfig,
    nodes_per_cell: int = 1,
) -> MemoryPlan | None:
    """The plan, or a ``RecipeError`` (one line) when a phase or a node does not fit; None where
    nothing is planned (no GPU size, or the model's shape is not known here)."""
    if model is None:
        return None
    p = plan(model, cells, engine, trainer, agent, nodes_per_cell)
    if p is not None and (why := p.refusal()):
        raise RecipeError(why)
    return p
